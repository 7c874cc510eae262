"""Activation checkpointing per block: same gradients, far fewer saved bytes, the model's names
untouched; the planner's memory model agrees with what the meter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.errors import UsageError
from hetrain.planning.memory import activation_bytes_per_sample, transformer_profile
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.runtime.memory.activation_checkpointing import apply_from_plan, checkpoint_blocks, find_blocks, is_checkpointed
from hetrain.emulation.device import MemoryMeter

CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=4, n_heads=4)


def gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def batch(n=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g))


def meter_and_grads(model, n=4):
    """The emulated meter after one forward and backward, and the gradients."""
    x, y = batch(n)
    meter = MemoryMeter(label="t", cap=None)
    meter.set_fixed(model, None)
    with meter.forward():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return meter, grads


def saved_bytes_and_grads(model, n=4):
    meter, grads = meter_and_grads(model, n)
    return meter.activations, grads


def test_blocks_are_the_modulelist_children_or_a_named_class():
    model = gpt()
    assert [n for n, _ in find_blocks(model)] == [f"blocks.{i}" for i in range(4)]
    assert [n for n, _ in find_blocks(model, "MLP")] == [f"blocks.{i}.mlp" for i in range(4)]
    with pytest.raises(UsageError, match="no module of class 'Nope'"):
        checkpoint_blocks(model, "Nope")
    with pytest.raises(UsageError, match="ModuleList"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_gradient_unchanged_and_saved_activations_drop():
    model = gpt()
    keys = list(model.state_dict())
    full, g0 = saved_bytes_and_grads(model)
    names = checkpoint_blocks(model)
    assert names == [f"blocks.{i}" for i in range(4)] and all(is_checkpointed(b) for b in model.blocks)
    assert checkpoint_blocks(model) == names               # idempotent: not wrapped twice
    ckpt, g1 = saved_bytes_and_grads(model)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert ckpt < full / 3, (full, ckpt)
    assert list(model.state_dict()) == keys                # names and checkpoints unchanged
    with torch.no_grad():                                  # evaluation runs plainly
        assert model(batch(1)[0]).shape == (1, CFG.seq_len, CFG.vocab_size)


def test_planning_model_of_checkpointing_matches_the_measurement():
    """planning/memory.py's transformer estimate, against the bytes the meter counts on the GPT."""
    profile = transformer_profile(seq_len=CFG.seq_len, d_model=CFG.d_model, n_layers=CFG.n_layers,
                                  vocab=CFG.vocab_size)
    n = 4
    full, _ = saved_bytes_and_grads(gpt(), n)
    model = gpt()
    checkpoint_blocks(model)
    ckpt, _ = saved_bytes_and_grads(model, n)
    # the meter counts the forward's saves: the recomputed block during backward is not in it
    est_full = activation_bytes_per_sample(profile, checkpointing=False) * n
    est_ckpt = (activation_bytes_per_sample(profile, checkpointing=True) - profile.block_saved) * n
    assert est_full == pytest.approx(full, rel=0.25), (est_full, full)
    assert est_ckpt == pytest.approx(ckpt, rel=0.25), (est_ckpt, ckpt)


def test_apply_from_plan_only_where_the_plan_says():
    plan = Plan(global_batch=8, devices=(
        DevicePlan(rank=0, device="a", speed=1, share=4, micro_batch=4),
        DevicePlan(rank=1, device="b", speed=1, share=4, micro_batch=4, checkpointing=True)))
    m0, m1 = gpt(), gpt()
    assert apply_from_plan(m0, plan, 0) == (plan, [])
    assert not any(is_checkpointed(b) for b in m0.blocks)
    assert apply_from_plan(m1, plan, 1)[1] == [f"blocks.{i}" for i in range(4)]
    everywhere, names = apply_from_plan(gpt(), plan, 0, mode="all")
    assert all(d.checkpointing for d in everywhere.devices) and len(names) == 4
    assert apply_from_plan(gpt(), plan, 1, mode="none") == (plan, [])
    # a rank that does not checkpoint still raises when a peer's model has nothing to checkpoint
    with pytest.raises(UsageError):
        apply_from_plan(torch.nn.Linear(2, 2), plan, 0)


def peak_and_grads(model, n=4):
    """The emulated meter's peak over one forward and backward (float64), and the gradients."""
    meter, grads = meter_and_grads(model, n)
    return meter.peak, grads


def test_the_first_k_blocks_only_same_gradients_and_a_peak_between_none_and_all():
    none, g_none = peak_and_grads(gpt().double())
    every = gpt().double()
    checkpoint_blocks(every)
    all_, _ = peak_and_grads(every)
    peaks = []
    for k in (1, 2, 3):
        model = gpt().double()
        assert checkpoint_blocks(model, count=k) == [f"blocks.{i}" for i in range(k)]
        assert [is_checkpointed(b) for b in model.blocks] == [i < k for i in range(4)]
        peak, g = peak_and_grads(model)
        assert all(torch.equal(a, b) for a, b in zip(g_none, g))      # recomputation replays the same ops
        peaks.append(peak)
    assert none > peaks[0] > peaks[1] > peaks[2] > all_, (none, peaks, all_)
    assert checkpoint_blocks(gpt(), count=0) == []
    with pytest.raises(UsageError, match="number of blocks"):
        checkpoint_blocks(gpt(), count=-1)


def test_apply_from_plan_checkpoints_the_plans_count_of_blocks():
    plan = Plan(global_batch=8, devices=(
        DevicePlan(rank=0, device="a", speed=1, share=4, micro_batch=4, checkpointing=True, checkpoint_blocks=2),
        DevicePlan(rank=1, device="b", speed=1, share=4, micro_batch=4, checkpointing=True)))
    m0 = gpt()
    assert apply_from_plan(m0, plan, 0)[1] == ["blocks.0", "blocks.1"]
    assert [is_checkpointed(b) for b in m0.blocks] == [True, True, False, False]
    assert len(apply_from_plan(gpt(), plan, 1)[1]) == 4                  # None: every block
    everywhere, names = apply_from_plan(gpt(), plan, 0, mode="all")   # 'all' overrides the count, recorded
    assert len(names) == 4 and all(d.checkpoint_blocks is None for d in everywhere.devices)
