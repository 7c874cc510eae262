"""Fabric's own loop, unchanged but for the strategy: `for epoch in range(2): for batch in loader:
zero_grad, backward, step` on two emulated ranks with uneven shares trains the same optimizer
steps over the same epochs as stock Fabric in one process on the whole global batch, to the same
float64 weights, in either setup order, with the user's DataLoader batch_size.

The reference is stock Fabric (devices=1, batch_size = the global batch) fed the sample order the
hetrain run drew, epoch by epoch, through its own sampler: the order is hetrain's seeded shuffle,
which the test also checks is a fresh permutation each epoch.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason='needs pip install "hetrain[lightning]"')]

N, BATCH, EPOCHS = 256, 32, 2             # batch_size 32 on 2 devices: a global batch of 64, 4 steps an epoch
SHARES, MICROS = (40, 24), (16, 12)       # rank 0: 3 micro-batches (14, 13, 13); rank 1: two of 12


class Points(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(N, 8, generator=g, dtype=torch.float64)
        self.y = (self.x[:, :4].sum(1) > 0).long() + 2 * (self.x[:, 4] > 0).long()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def make_plan() -> Plan:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (1.0, 0.67), SHARES, MICROS)))
    return Plan(global_batch=sum(SHARES), devices=devices)


class Indexed(Points):
    """The hetrain run's dataset also returns each sample's index, to record the order it drew."""

    def __getitem__(self, i):
        return self.x[i], self.y[i], torch.tensor(i)


def train(fabric, model, optimizer, loader, epochs=EPOCHS):
    """The standard Fabric loop; it records what it saw, nothing more."""
    out = {"steps": 0, "batches": [], "order": []}
    for _epoch in range(epochs):
        seen, order = 0, []
        for batch in loader:
            inputs, target = batch[0], batch[1]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), target)
            fabric.backward(loss)
            stepped = optimizer.step()
            out["steps"] += stepped is not None if len(batch) == 3 else 1
            seen += 1
            if len(batch) == 3:
                order += batch[2].tolist()
        out["batches"].append(seen)
        out["order"].append(order)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def worker(rank, world, plan, order):
    from lightning.fabric import Fabric

    from hetrain import Emulation, Rebalancing, Reporting
    from hetrain.integrations.lightning import HetrainStrategy

    config = {"plan": plan, "emulation": Emulation(cluster="a100-80g,rtx3090"),
              "rebalancing": Rebalancing(enabled=False), "reporting": Reporting(verbose=False)}
    # order "model first" names the global batch; "data first" leaves it to the DataLoader's batch_size
    strategy = HetrainStrategy(global_batch=64, **config) if order == "model first" else HetrainStrategy(**config)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    if order == "model first":
        model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
        loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
    else:
        loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    steps_per_epoch = len(loader)
    out = train(fabric, model, optimizer, loader)
    out["len"] = steps_per_epoch
    out["global_batch"] = strategy.engine.job.config.global_batch
    out["shares"] = strategy.engine.plan.shares
    strategy.close()
    return out


class Replay(Sampler):
    """Stock Fabric's sampler in the reference: epoch e's order as given (Fabric calls set_epoch)."""

    def __init__(self, orders):
        self.orders, self.epoch = orders, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(self.orders[self.epoch])

    def __len__(self):
        return N


def reference(orders, epochs=EPOCHS):
    """Stock Fabric, one process, the whole global batch per step, no hetrain."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=BATCH * 2, sampler=Replay(orders)))
    return train(fabric, model, optimizer, loader, epochs)


@pytest.fixture(scope="module", params=["model first", "data first"])
def runs(request):
    return run_ranks(worker, 2, make_plan(), request.param, timeout=180)


def stream_orders(r0, r1):
    """Each epoch's global order: per step, rank 0's contiguous slice, then rank 1's."""
    orders = []
    for e in range(EPOCHS):
        a, b, order = r0["order"][e], r1["order"][e], []
        for s in range(N // 64):
            order += a[s * SHARES[0]:(s + 1) * SHARES[0]] + b[s * SHARES[1]:(s + 1) * SHARES[1]]
        orders.append(order)
    return orders


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def test_fabrics_own_loop_trains_the_stock_steps_and_weights_on_uneven_shares(runs):
    r0, r1 = runs
    assert r0["global_batch"] == r1["global_batch"] == 64 and r0["shares"] == SHARES
    # each rank iterates its own micro-batches: 4 steps an epoch, of 3 (rank 0) and 2 (rank 1) batches
    assert r0["batches"] == [4 * 3] * EPOCHS and r1["batches"] == [4 * 2] * EPOCHS
    assert r0["len"] == r1["len"] == 4            # len(loader): optimizer steps an epoch, as stock's
    orders = stream_orders(r0, r1)
    for order in orders:                          # every sample once an epoch, and a new shuffle each epoch
        assert sorted(order) == list(range(N))
    assert orders[0] != orders[1] and orders[0] != list(range(N))
    ref = reference(orders)
    assert ref["steps"] == r0["steps"] == r1["steps"] == 4 * EPOCHS   # optimizer steps taken, 2 epochs
    for r in runs:
        assert max_diff(r["params"], ref["params"]) <= 1e-9
    # the tolerance sees a missing epoch: one epoch of stock is far from two
    assert max_diff(reference(orders, epochs=1)["params"], ref["params"]) > 1e-3
