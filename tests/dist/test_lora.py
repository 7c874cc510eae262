"""PEFT LoRA through plain ht.prepare: a tiny Llama (from its config, no download) with `peft` LoRA
adapters on q_proj and v_proj, trained on an emulated A100 + RTX 3090 with uneven shares, equals one
process training on the concatenated big batch; the frozen base stays bit-identical on every rank;
the optimizer holds the adapters only; and the runtime's memory plan costs the base as weights only,
as the emulated meters count it.

float64 throughout (the model, the adapters, the loss), with one caveat: Llama's RMSNorm computes in
float32 even in a float64 model, so the gradient passing through it is rounded to float32. The two
runs round the same values: with sample weighting a micro-batch of m samples scales its per-token
gradient by (m/B)/(m·8), and with B·8 = 256 a power of two that quotient is exactly 1/256, the big
batch's scale (token weighting's provisional scale is not exact, which is why the Fabric test uses
GPT-2). What is left is float64 summation order (measured: 5e-16 on the adapters), which could flip a
float32 rounding only rarely and then by ~1e-10; plain DDP's average of the ranks' means is 4e-2 off.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("peft") is None or
                                 importlib.util.find_spec("transformers") is None,
                                 reason='needs pip install "hetrain[hf]"')]

N, T, V, STEPS, RANK = 96, 9, 32, 3, 4            # T - 1 = 8 counted tokens a sample (the shift)
SHARES, MICROS = (20, 12), (7, 5)                  # rank 0: micro-batches 7 + 7 + 6; rank 1: 4 + 4 + 4
LR = 1e-2


def make_plan() -> Plan:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g#0", "rtx3090#1"), (1.0, 0.67), SHARES, MICROS)))
    return Plan(global_batch=sum(SHARES), devices=devices)


def tokens() -> torch.Tensor:
    return torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(3))


def lora_llama():
    """A 2-layer Llama from a config, LoRA r=4 on q_proj and v_proj (PEFT freezes the rest), float64."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T, use_cache=False)
    with warnings.catch_warnings():      # peft 0.21 asks transformers 5 by a deprecated name
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.0,
                                                                    target_modules=["q_proj", "v_proj"]))
    return model.double()


def lm_loss(model, x):
    """The mean next-token loss over every counted token, in float64 (transformers' own loss casts
    the logits to float32)."""
    logits = model(input_ids=x).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def worker(rank, world, plan):
    import hetrain

    model = lora_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ht = hetrain.init(global_batch=plan.global_batch, plan=plan, max_steps=STEPS, precision="fp32",
                      emulation=Emulation(cluster="a100-80g,rtx3090:1.0"),    # at speed 1: no sleeps, nothing timed
                      rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(tokens()),
                                     parallel=hetrain.DataParallel(sharding="none"))
    out = {"indices": [], "losses": [], "micro_sizes": []}
    for step in batches:
        sizes = []
        for mb in step:
            with mb:
                (x,) = mb.batch
                ht.backward(lm_loss(model, x))
            sizes.append(len(x))
        ht.step()
        out["indices"].append(list(step.indices))
        out["losses"].append(step.loss)
        out["micro_sizes"].append(sizes)
    names = {id(p): n for n, p in model.module.named_parameters()}
    out["optimized"] = sorted(names[id(p)] for g in opt.param_groups for p in g["params"])
    out["with_state"] = sorted(names[id(p)] for p in opt.state)
    out["trainable"] = sorted(n for n, p in model.module.named_parameters() if p.requires_grad)
    out["params"] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    out["start"] = start
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.module.buffers())
    out["memory"] = ht.summary()["memory"]
    ht.close()
    return out


def reference(step_indices, *, per_rank_mean=None):
    """One process, no hetrain: AdamW on the adapters over the mean loss of each step's
    concatenated samples. `per_rank_mean` (the shares): plain DDP's average of each rank's mean."""
    x = tokens()
    model = lora_llama()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for idx in step_indices:
        idx = torch.tensor(idx)
        parts = [idx] if per_rank_mean is None else torch.split(idx, list(per_rank_mean))
        loss = sum(lm_loss(model, x[p]) for p in parts) / len(parts)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, start, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(worker, 2, make_plan(), timeout=150)


def max_diff(a: dict, b: dict, names) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in names)


def test_lora_on_uneven_shares_equals_one_process_on_the_big_batch(runs):
    r0, r1 = runs
    assert r0["micro_sizes"] == [[7, 7, 6]] * STEPS and r1["micro_sizes"] == [[4, 4, 4]] * STEPS
    steps = [r0["indices"][s] + r1["indices"][s] for s in range(STEPS)]
    assert all(sorted(s) == sorted(set(s)) and len(s) == sum(SHARES) for s in steps)   # each sample once
    ref_losses, ref_start, ref_params = reference(steps)
    lora = r0["trainable"]
    assert lora and all("lora_" in n for n in lora) and r1["trainable"] == lora
    assert len(lora) == 2 * 2 * 2                  # A and B, of q_proj and v_proj, in each of 2 layers
    assert max_diff(ref_params, ref_start, lora) > 1e-3          # the adapters did train
    for r in runs:
        assert all(torch.equal(r["start"][n], ref_start[n]) for n in ref_start)    # the same start
        assert max_diff(r["params"], ref_params, lora) <= 1e-9
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-9)
    assert all(torch.equal(r0["params"][n], r1["params"][n]) for n in lora)     # the ranks agree exactly
    # The tolerance can see a wrong weighting: plain DDP's average of the ranks' means is far off.
    _, _, plain = reference(steps, per_rank_mean=SHARES)
    assert max_diff(plain, ref_params, lora) > 1e-3


def test_the_frozen_base_is_bit_identical_on_every_rank_and_the_optimizer_holds_the_adapters_only(runs):
    for r in runs:
        frozen = [n for n in r["params"] if n not in r["trainable"]]
        assert len(frozen) > len(r["trainable"])
        assert all(torch.equal(r["params"][n], r["start"][n]) for n in frozen)
        assert r["optimized"] == r["trainable"]
        assert r["with_state"] == r["trainable"]


def test_the_memory_plan_costs_the_frozen_base_as_weights_only(runs):
    r0 = runs[0]
    count = {n: p.numel() for n, p in r0["params"].items()}
    trainable = sum(count[n] for n in r0["trainable"])
    frozen = sum(count.values()) - trainable
    # float64: a frozen parameter is its 8-byte weight; an adapter's is weight, gradient and AdamW's 2 moments
    state = 8 * frozen + 8 * (1 + 1 + 2) * trainable
    assert state < 0.5 * 8 * 4 * (frozen + trainable)            # far below training all of it
    for row in r0["memory"]:
        assert row["planned_state"] == state, row
        assert row["held_state"] == state + r0["buffer_bytes"], row     # the meter: the tensors actually held
