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
CLUSTER = "a100-80g,rtx3090:1.0"          # the plan is given: at speed 1 no emulated device sleeps


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


def schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.2 * s))


def train(fabric, model, optimizer, loader, epochs=EPOCHS, scheduler=None):
    """The standard Fabric loop (the scheduler stepped every batch, as stock loops do); it records
    what it saw, nothing more."""
    out = {"steps": 0, "batches": [], "order": []}
    for _epoch in range(epochs):
        seen, order = 0, []
        for batch in loader:
            inputs, target = batch[0], batch[1]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), target)
            fabric.backward(loss)
            stepped = optimizer.step()
            if scheduler is not None:
                scheduler.step()
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

    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.integrations.lightning import HetrainStrategy

    config = {"plan": plan, "emulation": Emulation(cluster=CLUSTER),
              "rebalancing": Rebalancing(enabled=False), "reporting": Reporting(verbose=False)}
    # order "model first" names the global batch; "data first" leaves it to the DataLoader's batch_size
    strategy = HetrainStrategy(global_batch=64, **config) if order == "model first" else HetrainStrategy(**config)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    scheduler = None
    if order == "model first":       # with an LR scheduler, stepped every batch by the loop
        optimizer = make_optimizer(model.parameters())
        model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=schedule(optimizer))
        loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
    else:
        loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))
    steps_per_epoch = len(loader)
    assert len(loader.dataset) == N and loader.batch_size == BATCH     # read off the loader, as scripts do
    out = train(fabric, model, optimizer, loader, scheduler=scheduler)
    out["len"] = steps_per_epoch
    out["order_kind"] = order
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


def reference(orders, epochs=EPOCHS, *, scheduled=False):
    """Stock Fabric, one process, the whole global batch per step, no hetrain."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    scheduler = schedule(optimizer) if scheduled else None
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=BATCH * 2, sampler=Replay(orders)))
    return train(fabric, model, optimizer, loader, epochs, scheduler)


def pair_worker(rank, world, plan):
    """The two-rank cases that return, one after the other in one process group: each setup order,
    the OOMs in backward and forward, the refused collective, a rank leaving mid-step two ways."""
    from pipeline_runs import join_group

    join_group()
    return {"model first": worker(rank, world, plan, "model first"),
            "data first": worker(rank, world, plan, "data first"),
            "oom backward": oom_worker(rank, world, plan, BACKWARD_OOMS),
            "collective": collective_worker(rank, world, plan),
            "oom forward": oom_worker(rank, world, plan, FORWARD_OOM),
            "leave error": leave_worker(rank, world, plan, "error"),
            "leave no backward": leave_worker(rank, world, plan, "no backward")}


@pytest.fixture(scope="module")
def pair():
    """{case: [rank 0's result, rank 1's]} of pair_worker."""
    results = run_ranks(pair_worker, 2, make_plan(), timeout=600)
    return {case: [r[case] for r in results] for case in results[0]}


@pytest.fixture(scope="module")
def alone():
    """The one-rank cases, in turn in one process: {case: result}."""
    return run_ranks(alone_worker, 1, timeout=300)[0]


@pytest.fixture(params=["model first", "data first"])
def runs(pair, request):
    return pair[request.param]


def stream_orders(r0, r1, *, redone=False):
    """Each epoch's global order: per step, rank 0's contiguous slice, then rank 1's (`redone`: a
    sample of a redone micro-batch counted at its first sight; no sample comes twice otherwise)."""
    orders = []
    for e in range(EPOCHS):
        a, b, order = r0["order"][e], r1["order"][e], []
        if redone:
            a, b = list(dict.fromkeys(a)), list(dict.fromkeys(b))
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
    ref = reference(orders, scheduled=r0["order_kind"] == "model first")
    assert ref["steps"] == r0["steps"] == r1["steps"] == 4 * EPOCHS   # optimizer steps taken, 2 epochs
    for r in runs:
        assert max_diff(r["params"], ref["params"]) <= 1e-9
    # the tolerance sees a missing epoch: one epoch of stock is far from two
    assert max_diff(reference(orders, epochs=1)["params"], ref["params"]) > 1e-3
    if r0["order_kind"] == "model first":    # the schedule counts: unscheduled weights are far off
        assert max_diff(reference(orders)["params"], ref["params"]) > 1e-3


# -- out of memory in Fabric's own loop --------------------------------------------------------------
# In fabric.backward: recovered as in the step form. Rank 1 in its first backward of step 1 (12 -> 6,
# redone alone); rank 0 in its last backward of step 2, inside the gradient sync (16 -> 8, the step
# redone by both): the loader yields the redone micro-batches and the weights are the same.
BACKWARD_OOMS = "oom:rank=1,step=1,micro=0,phase=backward; oom:rank=0,step=2,micro=-1,phase=backward"


def oom_worker(rank, world, plan, faults):
    from lightning.fabric import Fabric

    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.errors import HetrainError
    from hetrain.integrations.lightning import HetrainStrategy

    strategy = HetrainStrategy(plan=plan, emulation=Emulation(cluster=CLUSTER, faults=faults),
                               rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
    try:
        out = train(fabric, model, optimizer, loader)
    except HetrainError as e:
        return {"error": (type(e).__name__, e.what, e.fix), "steps_done": strategy.engine.steps_done}
    out["micros"] = [d.micro_batch for d in strategy.engine.plan.devices]
    out["redone"] = strategy.engine.redone_steps
    strategy.close()
    return out


def test_an_oom_in_fabric_backward_is_recovered_in_the_plain_loop(pair):
    r0, r1 = pair["oom backward"]
    assert r0["micros"] == r1["micros"] == [8, 6] and r0["redone"] == r1["redone"] == 1
    # the loader yielded every redone micro-batch: rank 1's step 1 is 1 failed + 4 of 6; step 2 is
    # redone by both (rank 0: 3 + 5 of 8, rank 1: 4 + 4); the other steps at the plan's counts
    assert r0["batches"] == [3 + 3 + (3 + 5) + 5, 4 * 5] and r1["batches"] == [2 + (1 + 4) + (4 + 4) + 4, 4 * 4]
    assert r0["steps"] == r1["steps"] == 4 * EPOCHS
    ref = reference(stream_orders(r0, r1, redone=True))
    for r in (r0, r1):
        assert max_diff(r["params"], ref["params"]) <= 1e-9


# rank 1's first forward of step 1: its loop body cannot redo it, and rank 0 is not left waiting
FORWARD_OOM = "oom:rank=1,step=1,micro=0,phase=forward"


def test_an_oom_in_a_forward_of_the_plain_loop_stops_every_rank_with_one_agreed_error(pair):
    r0, r1 = pair["oom forward"]
    assert r0["error"] == r1["error"] and r0["steps_done"] == r1["steps_done"] == 1
    kind, what, fix = r0["error"]
    assert kind == "ForwardOutOfMemory"
    assert "at step 1, rank 1 (rtx3090) ran out of memory in a forward" in what and "cannot redo a forward" in what
    assert "for step in fabric.strategy.steps()" in fix and "max_micro_batch" in fix


def unpack_case():
    from lightning.fabric import Fabric

    from hetrain.errors import UsageError
    from hetrain.integrations.lightning import HetrainStrategy

    strategy = HetrainStrategy(memory={"max_micro_batch": 8})     # the global batch: batch_size 16 x 1 device
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    fabric.launch()
    model = make_model()
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=16))
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    try:
        for step in strategy.steps():
            inputs, target = step          # a step is not a batch
    except UsageError as e:
        return strategy.engine.job.config.global_batch, e.what, e.fix, len(loader)
    return "nothing raised"


def test_unpacking_a_step_says_a_step_is_not_a_batch(alone):
    global_batch, what, fix, steps_per_epoch = alone["unpack"]
    assert global_batch == 16 and steps_per_epoch == N // 16
    assert "micro-batch 1 of 2 in step 0 went by without fabric.backward(loss)" in what
    assert "if the step was unpacked (`inputs, target = step`), a step is not a batch" in what
    assert "for mb in step: with mb: inputs, target = mb.batch" in fix and "for batch in loader" in fix


def collective_worker(rank, world, plan):
    from lightning.fabric import Fabric

    from hetrain import Reporting
    from hetrain.emulation import Emulation
    from hetrain.errors import UsageError
    from hetrain.integrations.lightning import HetrainStrategy

    strategy = HetrainStrategy(plan=plan, emulation=Emulation(cluster=CLUSTER),
                               reporting=Reporting(verbose=False))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=BATCH))
    losses = []
    for inputs, target in loader:
        loss = F.cross_entropy(model(inputs), target)
        fabric.backward(loss)
        step = optimizer.step()
        if step is not None:         # where every rank meets: allowed
            losses.append(fabric.all_reduce(torch.tensor(step.loss), reduce_op="sum").item())
            if len(losses) == 2:
                break
    try:
        for inputs, target in loader:   # a new pass: its first batch is not the last of its step on either rank
            fabric.backward(F.cross_entropy(model(inputs), target))
            fabric.all_reduce(torch.tensor(1.0))
    except UsageError as e:
        return losses, e.what, e.fix
    return "nothing raised"


def test_a_collective_inside_a_global_step_is_refused_where_ranks_run_different_batches(pair):
    for losses, what, fix in pair["collective"]:
        assert len(losses) == 2 and losses[0] > 0
        assert "fabric.all_reduce inside a global step of Fabric's own loop" in what
        assert "if step is not None: fabric.all_reduce(...)" in fix


def capped_case():
    from lightning.fabric import Fabric

    from hetrain.integrations.lightning import HetrainStrategy

    strategy = HetrainStrategy(max_steps=5, memory={"max_micro_batch": 8})
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=16, shuffle=True))
    out = train(fabric, model, optimizer, loader)
    strategy.close()
    return out["batches"], strategy.engine.steps_done


def alone_worker(rank, world):
    return {"unpack": unpack_case(), "capped": capped_case()}


def test_max_steps_caps_the_loops_passes(alone):
    batches, steps = alone["capped"]
    assert steps == 5 and batches == [5 * 2, 0]      # 16 steps an epoch, 2 micro-batches each; then none


def leave_worker(rank, world, plan, how):
    from lightning.fabric import Fabric

    from hetrain import Reporting
    from hetrain.emulation import Emulation
    from hetrain.errors import HetrainError
    from hetrain.integrations.lightning import HetrainStrategy

    strategy = HetrainStrategy(plan=plan, emulation=Emulation(cluster=CLUSTER),
                               reporting=Reporting(verbose=False))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=BATCH))
    try:
        for inputs, target in loader:
            leaves = rank == 1 and strategy.engine.steps_done == 1      # mid-step: rank 0 must not wait for it
            loss = F.cross_entropy(model(inputs), target)
            if not (leaves and how == "no backward"):
                fabric.backward(loss)
            if leaves and how == "error":
                raise ValueError("the loop body's own error")
            if not leaves:
                optimizer.step()
    except (HetrainError, ValueError) as e:
        return type(e).__name__, getattr(e, "what", str(e)), strategy.engine.steps_done
    return "nothing raised"


@pytest.mark.parametrize("how", ["error", "no backward"])
def test_a_rank_leaving_the_loop_mid_step_stops_its_peers_with_one_error(pair, how):
    (kind0, what0, done0), (kind1, what1, done1) = pair[f"leave {how}"]
    if how == "error":                   # its own error goes on
        assert (kind1, what1) == ("ValueError", "the loop body's own error")
    else:
        assert kind1 == "UsageError" and "batch 1 of this rank's 2 in step 1 went by without fabric.backward" in what1
    assert kind0 == "LoopStopped" and done0 == done1 == 1
    assert "at step 1, rank 1 (rtx3090) left the loop in the middle of the step" in what0


def escape_worker(rank, world, plan, held):
    """Rank 1's loop body raises in the middle of step 1 and the error leaves the whole function;
    `held`: the script keeps the loader's iterator in a variable (closed here when the harness's
    handler drops the traceback; a real script's exit is the torchrun test below)."""
    from lightning.fabric import Fabric

    from hetrain import Reporting
    from hetrain.emulation import Emulation
    from hetrain.integrations.lightning import HetrainStrategy

    strategy = HetrainStrategy(plan=plan, emulation=Emulation(cluster=CLUSTER),
                               reporting=Reporting(verbose=False))
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, make_optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=BATCH))
    batches = iter(loader) if held else loader
    for inputs, target in batches:
        fabric.backward(F.cross_entropy(model(inputs), target))
        if rank == 1 and strategy.engine.steps_done == 1:
            raise ValueError("the loop body's own error")
        optimizer.step()
    return "nothing raised"


@pytest.mark.parametrize("held", [False, True], ids=["for loop", "iterator held"])
def test_a_loop_body_error_leaving_the_whole_function_stops_every_rank_without_a_hang(held):
    with pytest.raises(AssertionError) as failed:          # both ranks raised: neither hung
        run_ranks(escape_worker, 2, make_plan(), held, timeout=180)
    report = str(failed.value)
    assert "hung" not in report
    rank0, rank1 = report.split("rank 1: raised")
    assert "rank 0: raised" in rank0 and "LoopStopped" in rank0
    assert "at step 1, rank 1 (rtx3090) left the loop in the middle of the step" in rank0
    assert "ValueError: the loop body's own error" in rank1             # the rank's own error, reported


# A real script under torchrun: rank 1 raises out of the whole script while it keeps the loader's
# iterator in a variable, which the traceback Python keeps for the exit holds open; the loop's exit
# handler settles the step, so rank 0 raises LoopStopped instead of losing rank 1 in the sync.
HELD_SCRIPT = """
import os, sys
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from hetrain import Plan, Reporting
from hetrain.emulation import Emulation
from hetrain.integrations.lightning import HetrainStrategy

rank = int(os.environ["RANK"])
strategy = HetrainStrategy(plan=Plan.from_json(open(sys.argv[1]).read()), emulation=Emulation(cluster="a100-80g,rtx3090:1.0"),
                           reporting=Reporting(verbose=False))
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.3))
x = torch.randn(256, 8, dtype=torch.float64)
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()),
                                                              batch_size=32))
batches = iter(loader)
for inputs, target in batches:
    fabric.backward(F.cross_entropy(model(inputs), target))
    if rank == 1 and strategy.engine.steps_done == 1:
        raise ValueError("the loop body's own error")
    optimizer.step()
"""


def test_a_script_raising_out_of_itself_with_its_iterator_held_stops_every_rank(tmp_path):
    import os
    import subprocess
    import sys

    from harness import SRC, free_port

    script, plan = tmp_path / "train.py", tmp_path / "plan.json"
    script.write_text(HELD_SCRIPT)
    plan.write_text(make_plan().to_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(plan)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ValueError: the loop body's own error" in out                # rank 1's own error, reported
    assert "at step 1, rank 1 (rtx3090) left the loop in the middle of the step" in out, out[-3000:]
