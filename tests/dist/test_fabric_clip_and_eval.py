"""Fabric's own loop under hetrain's Fabric (the changed import, no launch()) on two emulated ranks
with uneven shares: fabric.clip_gradients by value (first epoch) and by norm (second) clips the step's gradient exactly
as stock Fabric does in one process on the whole global batch (float64, the same weights), and an
evaluation loader set up beside the training one is split across the ranks by the plan's shares,
so the script's `fabric.all_gather(loss_sum).sum() / len(dataset)` is one process's figure.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason='needs pip install "hetrain[lightning]"')]

N, BATCH, EPOCHS, TEST_N, TEST_BATCH = 128, 32, 2, 37, 5     # 2 steps an epoch of 64; 8 test batches
SHARES, MICROS = (40, 24), (16, 12)
CLIPS = ({"clip_val": 0.02}, {"max_norm": 0.05})       # by epoch


class Points(Dataset):
    def __init__(self, n=N, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        self.y = (self.x[:, :4].sum(1) > 0).long() + 2 * (self.x[:, 4] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def make_plan() -> Plan:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (1.0, 0.67), SHARES, MICROS)))
    return Plan(global_batch=sum(SHARES), devices=devices)


def train(fabric, model, optimizer, loader, test_loader, clips):
    """The stock loop of Lightning's examples: clip after each backward, evaluate each epoch."""
    out = {"norms": [], "test": [], "seen": []}
    for epoch in range(EPOCHS):
        model.train()
        for inputs, target in loader:
            optimizer.zero_grad()
            fabric.backward(F.cross_entropy(model(inputs), target))
            norm = fabric.clip_gradients(model, optimizer, **clips[epoch])
            optimizer.step()
            if norm is not None:         # read after optimizer.step(): the step's last one counts
                out["last_norm"] = norm
        out["norms"].append(float(out.pop("last_norm")) if "last_norm" in out else None)
        model.eval()
        loss_sum, seen = torch.zeros((), dtype=torch.float64), 0
        with torch.no_grad():
            for inputs, target in test_loader:
                loss_sum += F.cross_entropy(model(inputs), target, reduction="sum")
                seen += len(target)
        out["test"].append((fabric.all_gather(loss_sum).sum() / len(test_loader.dataset)).item())
        out["seen"].append(seen)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def worker(rank, world, plan):
    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.errors import UsageError
    from hetrain.integrations.lightning import Fabric, HetrainStrategy

    fabric = Fabric(strategy=HetrainStrategy(plan=plan, emulation=Emulation(cluster="a100-80g,rtx3090:1.0"),
                                             rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False)))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loader, test_loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=BATCH),
                                                   DataLoader(Points(TEST_N, seed=4), batch_size=TEST_BATCH))
    model, optimizer = fabric.setup(model, optimizer)
    out = train(fabric, model, optimizer, loader, test_loader, CLIPS)
    out["test_len"] = len(test_loader)
    whole = fabric.setup_dataloaders(DataLoader(Points(TEST_N, seed=4), batch_size=TEST_BATCH),
                                     use_distributed_sampler=False)
    out["whole_len"] = len(whole)
    try:                  # ranks run their own numbers of evaluation batches: a collective there would hang
        for _ in test_loader:
            fabric.barrier()
    except UsageError as e:
        out["inside_eval"] = (e.what, e.fix)
    fabric.strategy.close()
    return out


def reference(clips=CLIPS):
    """Stock Fabric, one process, the whole global batch a step, the same order (no shuffle)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader, test_loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=2 * BATCH),
                                                   DataLoader(Points(TEST_N, seed=4), batch_size=TEST_BATCH))
    return train(fabric, model, optimizer, loader, test_loader, clips)


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def test_clip_gradients_and_the_split_evaluation_equal_stock_fabric_in_one_process():
    r0, r1 = run_ranks(worker, 2, make_plan(), timeout=180)
    ref = reference()
    for r in (r0, r1):
        assert max_diff(r["params"], ref["params"]) <= 1e-12
        # the script's all_gather of each rank's sum over len(dataset): one process's loss, not W times it
        assert r["test"] == pytest.approx(ref["test"], abs=1e-12)
    # the norm fabric.clip_gradients(max_norm=) returns: the step's, filled in by the step
    assert r0["norms"][0] is None and r0["norms"] == r1["norms"] == pytest.approx(ref["norms"], abs=1e-12)
    # each clip acts: without either, stock reaches other weights
    for clips in (({"clip_val": 1e9}, CLIPS[1]), (CLIPS[0], {"max_norm": 1e9})):
        assert max_diff(reference(clips)["params"], ref["params"]) > 1e-4
    # 8 test batches split 40:24 by the plan, contiguous and whole: 5 batches (25 samples) and 3 (12)
    assert [r0["seen"], r1["seen"]] == [[25] * EPOCHS, [12] * EPOCHS]
    assert (r0["test_len"], r1["test_len"]) == (5, 3)
    assert r0["whole_len"] == r1["whole_len"] == 8      # use_distributed_sampler=False: not split
    what, fix = r0["inside_eval"]
    assert "fabric.barrier inside a pass over an evaluation loader" in what and "after the evaluation loop" in fix
