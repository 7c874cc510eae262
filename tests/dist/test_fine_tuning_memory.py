"""Fine-tuning with a frozen base: the runtime's memory plan counts gradients and optimizer state
for the trainable (requires_grad) parameters only, the frozen base as weights at its own dtype
(bf16 here, beside fp32 adapters, as LoRA is usually run), and the emulated devices' meters —
which count the tensors actually held — agree with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N, D, R, LAYERS = 64, 128, 4, 4


class LoraLinear(nn.Module):
    """A frozen bf16 linear plus a trainable rank-R adapter B·A (fp32)."""

    def __init__(self, d: int, r: int):
        super().__init__()
        self.base = nn.Linear(d, d, bias=False).to(torch.bfloat16).requires_grad_(False)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.base(x.to(torch.bfloat16)).float() + self.b(self.a(x)))


class LoraNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(LoraLinear(D, R) for _ in range(LAYERS))
        self.head = nn.Linear(D, 1).requires_grad_(False)     # a frozen fp32 part too

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def worker(rank, world, steps):
    import hetrain

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)
    model = LoraNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = Plan(global_batch=16, devices=(DevicePlan(rank=0, device="a100-80g#0", speed=1.0, share=8, micro_batch=4),
                                          DevicePlan(rank=1, device="rtx3090#1", speed=1.0, share=8, micro_batch=8)))
    ht = hetrain.init(global_batch=16, plan=plan, max_steps=steps, precision="fp32",
                      emulation=Emulation(cluster="a100-80g@64MiB,rtx3090:1.0@24MiB"), reporting=Reporting(verbose=False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y),
                                     parallel=hetrain.DataParallel(sharding="none"))
    for step in batches:
        for mb in step:
            with mb:
                bx, by = mb.batch
                ht.backward(F.mse_loss(model(bx), by))
        ht.step()
    changed = {n: not torch.equal(p.detach(), before[n]) for n, p in model.module.named_parameters()}
    memory = ht.summary()["memory"]
    ht.close()
    return {"memory": memory, "changed": changed}


def test_frozen_base_costs_weights_only_and_planned_matches_measured():
    r0, _ = run_ranks(worker, 2, 2)
    # only the adapters trained
    assert all(v == (".a." in n or ".b." in n) for n, v in r0["changed"].items()), r0["changed"]
    frozen_bf16 = LAYERS * D * D * 2
    frozen_fp32 = (D + 1) * 4
    trainable = LAYERS * R * 2 * D
    state = frozen_bf16 + frozen_fp32 + trainable * 4 * (1 + 1 + 2)   # weights, grads, AdamW's 2 moments
    for row in r0["memory"]:
        assert row["planned_state"] == pytest.approx(state), row
        assert row["held_state"] == pytest.approx(state), row          # the meter, from the tensors held
        assert row["measured"] == pytest.approx(row["planned"], rel=0.10), row
