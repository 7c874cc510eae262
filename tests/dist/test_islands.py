"""Data parallel across device islands (runtime/ranks/islands.py, runtime/sharding/island_hooks.py) on real gloo
groups: the hierarchical all-reduce sums exactly what a flat all-reduce sums, in the sharded form
(equal islands) and the leaders' form (unequal ones); only bridge ranks touch the bridge, each
with host tensors; the emulated bridge is slowed to its link; and a training job spanning islands
takes it automatically and equals one process (float64, 1e-12), an OOM redo included."""

from __future__ import annotations

import time

import pytest
import torch

from harness import run_ranks

pytestmark = pytest.mark.dist


def sums(rank, world, island_of, bridge_gbs, sizes, links=None):
    """Hierarchical sums of `sizes` float64 values over the ranks' process group, beside a flat one."""
    import torch.distributed as dist

    from hetrain.emulation.islands import paced_link
    from hetrain.runtime.ranks.islands import Islands, make_groups
    from hetrain.runtime.sharding.island_hooks import IslandSync, attach_links

    islands = Islands(island_of=tuple(island_of), bridge_gbs=bridge_gbs, links_gbs=links or {}, link=paced_link)
    groups = attach_links(make_groups(islands, rank=rank))
    sync = IslandSync(groups, world_size=world, device=torch.device("cpu"))
    out = []
    started = time.monotonic()
    for size in sizes:          # sizes that do and do not divide by an island's ranks
        g = torch.Generator().manual_seed(100 * size + rank)
        mine = torch.randn(size, dtype=torch.float64, generator=g)
        flat = mine.clone()
        dist.all_reduce(flat)                      # the reference: one flat all-reduce over every rank
        got = sync.reduce(mine.clone()).wait()
        out.append((got - flat / world).abs().max().item())
    elapsed = time.monotonic() - started
    sync.close()
    result = {"elapsed": elapsed, "carried": groups.bridge_link.sent_bytes if groups.bridge_link else None,
              "diffs": out, "bridged": groups.bridged_bytes, "bridge_ranks": groups.bridge_ranks,
              "native_ranks": groups.native_ranks,
              "throttled": groups.bridge_link is not None,
              "native_carried": groups.native_link.sent_bytes if groups.native_link else None}
    return result


SIZES = (1, 7, 64)                     # sizes that do and do not divide by an island's ranks
BRIDGE_GBS = 8 * 72 / 0.05 / 1e9       # 50 ms a sum of 72 float64 (the 2+1 leaders' form: a 2-leader ring,
                                       # 2(k-1)/k · S / B = S / B)


def islands_worker(rank, world):
    """Every case on this many ranks, one after the other in one process group: 4 ranks are
    islands 2+2, 3 ranks 2+1 (and the 2+1 sums on an emulated bridge and links)."""
    from pipeline_runs import join_group

    join_group()
    name = {4: "2+2", 3: "2+1"}[world]
    island_of = ISLANDS[name]
    out = {"sum": sums(rank, world, island_of, None, SIZES)}
    if world == 3:
        out["slowed"] = sums(rank, world, island_of, BRIDGE_GBS, (72, 72), {"nv": 100.0, "amd": 100.0})
    island_of, shares, micros, faults = CASES[next(c for c in CASES if c.startswith(name))]
    out["train"] = train_worker(rank, world, island_of, make_plan(shares, micros), STEPS, faults)
    return out


ISLANDS = {"2+2": ("nv", "nv", "amd", "amd"), "2+1": ("nv", "nv", "amd")}


@pytest.fixture(scope="module")
def runs():
    """{"2+2": [each rank's], "2+1": [each rank's]}."""
    return {name: run_ranks(islands_worker, len(island_of), timeout=300) for name, island_of in ISLANDS.items()}


@pytest.mark.parametrize("name", ISLANDS)
def test_hierarchical_sum_equals_a_flat_all_reduce(runs, name):
    """(2+2 runs again inside a training job below; here the sizes an island's ranks do not divide.)"""
    results = [r["sum"] for r in runs[name]]
    for r in results:
        assert max(r["diffs"]) <= 1e-12
    nbytes = 8 * sum(SIZES)
    if name == "2+2":      # sharded: rank j of each island carries its half, padded
        assert [r["bridge_ranks"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
        assert [r["bridged"] for r in results] == [8 * (1 + 4 + 32)] * 4
    else:                        # leaders: ranks 0 and 2 carry everything, rank 1 never crosses
        assert [r["bridge_ranks"] for r in results] == [(0, 2), (), (0, 2)]
        assert [r["bridged"] for r in results] == [nbytes, 0.0, nbytes]


def test_the_emulated_bridge_and_island_links_are_slowed_to_their_figures(runs):
    results = [r["slowed"] for r in runs["2+1"]]
    assert [r["throttled"] for r in results] == [True, False, True]     # a non-leader never crosses
    # island nv's link carries each sum's reduce and broadcast (half an all-reduce's bytes each);
    # amd, an island of one, has no link to cross
    assert [r["native_carried"] for r in results] == [2 * 8 * 72, 2 * 8 * 72, None]
    for r in results:
        assert max(r["diffs"]) <= 1e-12
        assert r["elapsed"] >= 0.1       # two sums of 50 ms on the link (a lower bound on any host)
    assert results[0]["carried"] == results[2]["carried"] == 2 * 8 * 72


N, D = 96, 6


def make_plan(shares, micros):
    from hetrain.planning.plan import DevicePlan, Plan

    devices = tuple(DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=s, micro_batch=m)
                    for r, (s, m) in enumerate(zip(shares, micros)))
    return Plan(global_batch=sum(shares), devices=devices)


def data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x, x[:, :1] * 2 + 0.1 * torch.randn(N, 1, generator=g, dtype=torch.float64)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def island_spec(island_of) -> str:
    """An island spec of A100s with these islands (the bridge: the cards' own PCIe to host memory)."""
    return "; ".join(f"{name}={island_of.count(name)}xa100-80g" for name in dict.fromkeys(island_of)) + "; bridge=host"


def train_worker(rank, world, island_of, plan, steps, faults):
    """A training job over the ranks' process group, each rank's device in island_of[rank]."""
    import torch.nn.functional as F

    import hetrain
    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation

    ht = hetrain.init(global_batch=plan.global_batch, plan=plan, max_steps=steps, precision="fp32",
                      emulation=Emulation(cluster=island_spec(island_of), faults=faults),
                      rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False))
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(*data()))
    indices = []
    for step in batches:
        for mb in step:
            with mb:
                x, y = mb.batch
                ht.backward(F.mse_loss(model(x), y))
        indices.append(list(step.indices))
        ht.step()
    hook = getattr(ht.job.guard, "gradient", None)
    out = {"params": [p.detach().clone() for p in model.parameters()], "indices": indices,
           "hook": type(hook).__name__, "bridged": getattr(getattr(hook, "groups", None), "bridged_bytes", 0.0),
           "redone": ht.summary()["redone_steps"], "micro": ht.plan.devices[rank].micro_batch}
    ht.close()
    return out


def reference(step_indices):
    import torch.nn.functional as F

    x, y = data()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for idx in step_indices:
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


STEPS = 3
CASES = {"2+2": (("nv", "nv", "amd", "amd"), (6, 10, 7, 9), (3, 5, 7, 3), None),
         # an OOM in the bridge leader's last backward: its peers wait inside the island's reduce and
         # the bridge; it completes them with zero buckets, every rank redoes the step
         "2+1, OOM": (("nv", "nv", "amd"), (12, 8, 12), (4, 8, 6), "oom:rank=2,step=1,micro=-1,phase=backward")}


@pytest.mark.parametrize("case", CASES)
def test_data_parallel_across_islands_equals_one_process(runs, case):
    island_of, shares, micros, faults = CASES[case]
    steps = STEPS
    records = [r["train"] for r in runs[case.split(",")[0]]]
    step_indices = [sum((r["indices"][s] for r in records), []) for s in range(steps)]
    assert all(sorted(i) == sorted(set(i)) and len(i) == sum(shares) for i in step_indices)
    ref = reference(step_indices)
    for rank, r in enumerate(records):
        assert r["hook"] == "IslandSync"
        assert max((a - b).abs().max().item() for a, b in zip(r["params"], ref)) <= 1e-12
    if len(island_of) == 4:     # sharded: one bucket of 129 float64 a step, padded to 130, half each
        assert [r["bridged"] for r in records] == [steps * 8 * 65] * 4
    else:                       # leaders: the whole bucket, a step; rank 1 never crosses
        assert [r["bridged"] for r in records] == [(steps + 1) * 8 * 129, 0.0, (steps + 1) * 8 * 129]
    if faults:
        assert [r["redone"] for r in records] == [1, 1, 1] and records[2]["micro"] == 3

