"""Activation checkpointing on only the device whose plan asks for it: the gradient is the
single-device big-batch gradient, and that device's saved activations drop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N = 96
CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)


def make_plan() -> Plan:
    # the 3090 (rank 1) is the small device: checkpointing there only; both run micro-batches of 4
    return Plan(global_batch=20, devices=(
        DevicePlan(rank=0, device="a100", speed=1.0, share=12, micro_batch=4),
        DevicePlan(rank=1, device="3090", speed=0.67, share=8, micro_batch=4, checkpointing=True)))


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CFG.vocab_size, (N, CFG.seq_len), generator=g), \
        torch.randint(0, CFG.vocab_size, (N, CFG.seq_len), generator=g)


def model_for():
    torch.manual_seed(0)
    return GPT(CFG)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def worker(rank, world, steps):
    import hetrain
    from hetrain.runtime.memory.activation_checkpointing import is_checkpointed

    x, y = data()
    ht = hetrain.init(global_batch=20, plan=make_plan(), emulation=Emulation(cluster="a100-80g,rtx3090:1.0"),    # speed 1: no sleeps
                      reporting=Reporting(verbose=False), precision="fp32",
                      max_steps=steps)
    model = model_for()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y))
    out = {"indices": [], "grads": [], "act_per_sample": []}
    meter = ht.emulated.meter
    for step in batches:
        for mb in step:
            with mb:
                bx, by = mb.batch
                loss = loss_of(model, bx, by)
                out["act_per_sample"].append(meter.activations / mb.size)  # saved by this forward
                ht.backward(loss)
        out["grads"].append([p.grad.detach().clone() for p in model.module.parameters()])
        out["indices"].append(list(step.indices))
        ht.step()
    out["params"] = [p.detach().clone() for p in model.module.parameters()]
    out["checkpointed"] = [is_checkpointed(b) for b in model.module.blocks]
    out["memory"] = ht.summary()["memory"]
    ht.close()
    return out


def test_checkpointing_only_on_the_small_device_keeps_the_big_batch_gradient():
    steps = 2
    r0, r1 = run_ranks(worker, 2, steps)
    assert r0["checkpointed"] == [False, False] and r1["checkpointed"] == [True, True]

    model = model_for()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    for s in range(steps):
        idx = torch.tensor(r0["indices"][s] + r1["indices"][s])
        loss_of(model, x[idx], y[idx]).backward()
        for r in (r0, r1):
            for got, want in zip(r["grads"][s], model.parameters()):
                assert torch.allclose(got, want.grad, atol=1e-6, rtol=1e-5), (got - want.grad).abs().max()
        opt.step()
        opt.zero_grad()
    for r in (r0, r1):
        for got, want in zip(r["params"], model.parameters()):
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)

    # same micro-batch size on both: the checkpointed device saves far fewer bytes per sample
    a0, a1 = max(r0["act_per_sample"]), max(r1["act_per_sample"])
    assert a1 < a0 / 2, (a0, a1)
    # and the memory report shows it: planned and measured, both lower on the checkpointed rank
    m0, m1 = r0["memory"]
    assert m1["planned_activations"] < m0["planned_activations"] / 2
    for m in (m0, m1):
        assert m["measured"] == pytest.approx(m["planned"], rel=0.10), m
