"""A step of the model split by speed, timed for the ranking's TP row (runtime/measure/tp_probe.py),
on 2 gloo ranks with emulated devices: it runs on a copy (the job's model and gradients are left as
they were), times forward + backward and the optimizer apart, and a model with no layers to split
raises the same UsageError on every rank, before any collective. It counts what each rank held:
its shards' state (more on the faster rank's larger part) and the activations its forward saved
(fewer than the whole model's, more than nothing), every rank's in rank order on every rank."""

from __future__ import annotations

import pytest

from harness import run_ranks
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist


def worker(rank, world):
    import torch
    from torch import nn

    import hetrain
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.errors import UsageError
    from hetrain.runtime.layouts.tensor.probe import time_tp_step

    ht = hetrain.init(global_batch=8, emulation=Emulation(cluster="a100-80g,rtx3090:0.5"),
                      reporting=Reporting(verbose=False), precision="fp32")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    found = time_tp_step(model, opt, batch, forward=lambda m, b: m(b[0]), device=ht.job.device, precision="fp32",
                         speeds=[1.0, 0.5], measuring=ht.job.hooks.measuring())
    try:
        time_tp_step(nn.Sequential(nn.Tanh()), opt, batch, forward=lambda m, b: m(b[0].float()),
                     device=ht.job.device, precision="fp32", speeds=[1.0, 0.5])
        refused = None
    except UsageError as e:
        refused = e.what
    from hetrain.emulation.device import MemoryMeter, model_state_bytes

    meter = MemoryMeter(label="whole", cap=None)
    meter.set_fixed(model, None)
    with meter.forward():
        whole_loss = model(batch[0])
    whole_act = meter.activations
    del whole_loss
    out = {"found": found, "refused": refused, "whole": [model_state_bytes(model, None), whole_act],
           "model_unchanged": all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
           "no_grads": all(p.grad is None for p in model.parameters()), "no_state": not opt.state}
    ht.close()
    return out


def test_the_tp_probe_times_a_split_step_on_a_copy_and_refuses_alike_on_every_rank():
    r0, r1 = run_ranks(worker, 2, timeout=240)
    for r in (r0, r1):
        f = r["found"]
        assert f["fb_s"] > 0 and f["opt_s"] > 0 and f["micro_batch"] == 4 and f["runs"] >= 3, f
        # barrier to barrier: the slowest rank sets both ranks' figures, within the timer's jitter
        assert r["model_unchanged"] and r["no_grads"] and r["no_state"]
        assert r["refused"] and "no attention" in r["refused"], r["refused"]
    held = r0["found"]["memory"]
    assert held == r1["found"]["memory"] and len(held) == 2
    params, act = r0["whole"]                       # the whole model's parameters, its forward's activations
    assert held[0][0] > held[1][0] > 0              # 2/3 of the heads and columns against 1/3, with AdamW state
    assert all(params / 2 < state for state, _ in held)      # parameters, gradients and two moments of a part
    assert all(0 < a < act for _, a in held), (held, act)
    assert abs(r0["found"]["fb_s"] - r1["found"]["fb_s"]) < 0.5 * max(r0["found"]["fb_s"], r1["found"]["fb_s"])
