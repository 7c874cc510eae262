"""Resilience inside a running job: out-of-memory recovery without deadlock, and online
rebalancing that follows a real change of speed but not timing noise."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.planning.shares import proportional_shares
from hetrain.runtime.resilience.resume import read_sample_log
from hetrain import Memory, Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N, D = 192, 16


def data(n=N):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, D, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 2 + 0.1 * torch.randn(n, 1, generator=g))


def model(width=32, hidden=0):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(D, width), torch.nn.Tanh()]
    for _ in range(hidden):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def train(emulate, steps, *, width=32, hidden=0, global_batch=48, n=N, net=None, momentum=0.9, faults=None,
          sample_log=None, **config):
    import hetrain

    ht = hetrain.init(global_batch=global_batch, max_steps=steps, emulation=Emulation(cluster=emulate, faults=faults),
                      reporting=Reporting(verbose=False, sample_log=sample_log), **config)
    net = net if net is not None else model(width, hidden)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum)
    net, opt, batches = ht.prepare(net, opt, data(n))
    shares = []
    for step in batches:
        for mb in step:
            with mb:
                x, y = mb.batch
                ht.backward(F.mse_loss(net(x), y))
        shares.append(ht.plan.shares)
        ht.step()
    out = {"params": [p.detach().clone() for p in net.parameters()], "shares": shares,
           "plan": ht.plan, "summary": ht.summary()}
    ht.close()
    return out


CASES = [(0, 0, "forward"), (1, 0, "forward"),      # first micro-batch's forward: local redo
         (0, -1, "backward"), (1, -1, "backward")]  # last micro-batch's backward: inside the gradient sync
OOM_PLAN = ((29, 19), 8)     # shares by the pair's catalog speeds 1 : 0.67, micro-batches of at most 8
OOM_CLUSTER = "a100-80g,rtx3090:1.0"     # the OOM jobs' plans are given: at speed 1 no device sleeps


def oom_job(faults, log_dir):
    from plans import data_plan

    shares, micro = OOM_PLAN
    return train(OOM_CLUSTER, 6, memory=Memory(max_micro_batch=8), rebalancing=Rebalancing(enabled=False),
                 faults=faults, sample_log=log_dir, plan=data_plan(shares, (micro, micro)))


def fatal_job():
    from hetrain.errors import HetrainError
    from plans import data_plan

    try:
        train(OOM_CLUSTER, 3, memory=Memory(max_micro_batch=1), global_batch=4,
              faults="oom:rank=1,step=1,micro=0,phase=forward", plan=data_plan((2, 2), (1, 1)))
    except HetrainError as e:
        return e.what
    return "finished"


def oom_worker(rank, world, root):
    """The clean run, each injected OOM, the redo with buffers and the OOM that cannot shrink, one
    job after another in one process group (each case's result under its own key; the fatal one
    last)."""
    from pipeline_runs import join_group

    join_group()
    out = {"clean": oom_job(None, f"{root}/clean")}
    for rank_, micro, phase in CASES:
        out[rank_, micro, phase] = oom_job(f"oom:rank={rank_},step=2,micro={micro},phase={phase}",
                                           f"{root}/{rank_}{micro}{phase}")
    for micro_batch in (8, None):
        out["buffers", micro_batch] = buffered_job(rank, micro_batch)
    out["fatal"] = fatal_job()
    return out


def rebalance_group(rank, world):
    from pipeline_runs import join_group

    join_group()
    return rebalance_cases(rank, world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The OOM cases in one process group, and beside it the rebalancing ones in another: they run
    on the controlled clock, a step mostly its sleeps, whatever else the host runs."""
    root = tmp_path_factory.mktemp("oom")
    with ThreadPoolExecutor(2) as pool:
        oom = pool.submit(run_ranks, oom_worker, 2, str(root), timeout=450)
        rebalance = pool.submit(run_ranks, rebalance_group, 2, timeout=450)
        return root, [{"oom": o, "rebalance": r} for o, r in zip(oom.result(), rebalance.result())]


@pytest.fixture(scope="module")
def oom_runs(runs):
    root, results = runs
    return root, [r["oom"] for r in results]


@pytest.mark.parametrize("rank, micro, phase", CASES)
def test_oom_recovers_with_the_same_result_and_every_sample_once(oom_runs, rank, micro, phase):
    root, runs = oom_runs
    clean_params = runs[0]["clean"]["params"]
    r0, r1 = (r[rank, micro, phase] for r in runs)
    for r in (r0, r1):
        assert max((a - b).abs().max().item() for a, b in zip(r["params"], clean_params)) <= 1e-5
    plan = r0["plan"]
    assert plan == r1["plan"] and plan.version == 1                 # one agreed amendment...
    assert plan.devices[rank].micro_batch == 4                      # ...halving that rank's micro-batch
    assert plan.devices[1 - rank].micro_batch == 8
    assert "out of memory at step 2" in plan.note
    assert [r["ooms"] for r in r0["summary"]["ranks"]] == [1 if i == rank else 0 for i in range(2)]
    assert r0["summary"]["redone_steps"] == (1 if phase == "backward" else 0)
    steps = read_sample_log(str(root / f"{rank}{micro}{phase}"))
    used = [pair for s in sorted(steps) for pair in steps[s]]          # (epoch, index)
    assert len(steps) == 6 and len(used) == 6 * 48 and len(set(used)) == len(used)   # 288: epoch 0 + half of 1
    epoch0 = [i for s in sorted(steps) for e, i in steps[s] if e == 0]
    assert sorted(epoch0) == list(range(N))


def test_an_oom_that_cannot_shrink_stops_every_rank_together(oom_runs):
    a, b = (r["fatal"] for r in oom_runs[1])
    assert a == b and "micro-batch of 1 sample on rank 1" in a


# -- rebalancing ---------------------------------------------------------------------------------
def efficiency(shares, speeds) -> float:
    """Throughput of a split relative to the best split, for these true speeds."""
    def step_time(s):
        return max(b / v for b, v in zip(s, speeds))
    return step_time(proportional_shares(sum(shares), speeds)) / step_time(shares)


SAMPLE_S = 0.003     # the controlled clock: 3 ms per sample at speed 1 (the CPU needs well under 1)


def rebalance_job(faults, steps):
    """A small GPT on the controlled clock (emulate_sample_s): a micro-batch of m samples lasts
    m·3 ms/speed whatever the host's CPU took or how busy the host is, so the ideal split is the
    one proportional to the devices' speeds on any host. (The CPU still computes every step; the
    real-clock path is what the demo and the benchmarks run.) It starts from a given plan split by
    the catalog's speeds: what moves it is the rebalancer, on the step times it measures."""
    import hetrain
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes
    from plans import speed_plan

    ht = hetrain.init(global_batch=64, max_steps=steps, plan=speed_plan(64, (1.0, 0.67)),
                      emulation=Emulation(cluster="a100-80g:1.0,rtx3090:0.67", faults=faults, sample_s=SAMPLE_S),
                      reporting=Reporting(verbose=False))
    torch.manual_seed(0)
    net = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net, opt, batches = ht.prepare(net, opt, ByteWindows(pydoc_bytes()[:100_000], 64))
    shares = []
    for step in batches:
        for mb in step:
            with mb:
                x, y = mb.batch
                ht.backward(F.cross_entropy(net(x).flatten(0, 1), y.flatten()))
        shares.append(ht.plan.shares)
        ht.step()
    out = {"shares": shares, "plan": ht.plan}
    ht.close()
    return out


def rebalance_worker(rank, world, faults, steps):
    """One rebalancing job in its own process group (test_async_emulation.py's, with its env)."""
    return rebalance_job(faults, steps)


SLOW_AT = 8


def rebalance_cases(rank, world):
    """Both rebalancing cases, one job after the other in the ranks' process group."""
    return {"slowdown": rebalance_job(f"slow:rank=0,step={SLOW_AT},factor=2", 26),
            "noise": rebalance_job("noise:rank=-1,step=0,factor=0.1", 24)}


@pytest.fixture(scope="module")
def rebalance_runs(runs):
    return [r["rebalance"] for r in runs[1]]


def test_rebalancing_follows_a_slowdown_within_ten_steps(rebalance_runs):
    slow_at = SLOW_AT
    r0, r1 = (r["slowdown"] for r in rebalance_runs)
    assert r0["shares"] == r1["shares"]                               # every rank the same plan
    after = [1.0 / 2, 0.67]                         # the emulated speeds after the slowdown
    reached = [efficiency(s, after) for s in r0["shares"][slow_at + 10:]]
    assert min(reached) >= 0.95, (r0["shares"], reached)
    assert r0["plan"].version >= 1 and "rebalanced" in r0["plan"].note


def test_timing_noise_does_not_move_shares(rebalance_runs):
    r0 = rebalance_runs[0]["noise"]
    assert len(set(r0["shares"])) == 1 and r0["plan"].version == 0, r0["shares"]


def buffered_job(rank, micro_batch):
    """A model with buffers (BatchNorm): DDP broadcasts them in a step's first forward. The split is
    given (28 : 20), so the redo's halved micro-batch is never a single sample, which BatchNorm
    cannot train on (a measured split of this tiny model can give the 3090 only a few samples)."""
    from hetrain.planning.plan import DevicePlan, Plan

    micro = micro_batch or 48
    plan = Plan(global_batch=48, devices=(
        DevicePlan(rank=0, device="a100-80g", speed=1.0, share=28, micro_batch=min(micro, 28)),
        DevicePlan(rank=1, device="rtx3090", speed=0.67, share=20, micro_batch=min(micro, 20))))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    out = train(OOM_CLUSTER, 4, net=net, momentum=0.0, rebalancing=Rebalancing(enabled=False), plan=plan,
                faults="oom:rank=1,step=2,micro=0,phase=forward")
    summary = out["summary"]
    return {"steps": summary["steps"], "ooms": summary["ranks"][rank]["ooms"],
            "micro": out["plan"].devices[1].micro_batch}


@pytest.mark.parametrize("micro_batch", [8, None])   # several micro-batches; one (the synced forward)
def test_oom_redo_with_buffers_does_not_repeat_the_buffer_broadcast(oom_runs, micro_batch):
    r0, r1 = (r["buffers", micro_batch] for r in oom_runs[1])   # a repeated broadcast hangs (past the deadline)
    assert r0["steps"] == r1["steps"] == 4 and r1["ooms"] == 1
    assert r1["micro"] == (4 if micro_batch else 10)       # halved once, on the rank that ran out
