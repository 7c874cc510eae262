"""Config.num_workers (the Trainer's dataloader_num_workers): each rank's micro-batches read by
worker processes on real gloo ranks with uneven shares, to the weights of one process, with the
samples read outside the rank's own process; an OOM that cuts the micro-batches mid-step reads the
redo's smaller ones through the same workers.

Reference: one process stepping on the global batches in hetrain's order (the sample log), float64:
independent of the reader."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Reporting
from hetrain.emulation import Emulation
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = pytest.mark.dist

N, D, B, STEPS = 40, 4, 16, 5


class Pids(torch.utils.data.Dataset):
    """(x, y, the pid of the process that read the sample)."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(N, D, generator=g, dtype=torch.float64)
        self.y = self.x[:, :1] * 0.5 - self.x[:, 2:3]

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], torch.tensor(os.getpid())


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def plan() -> Plan:
    # 6 and 10 of every 16: three micro-batches (2, 2, 2) against two (5, 5)
    return Plan(global_batch=B, devices=(DevicePlan(rank=0, device="cpu0", speed=0.6, share=6, micro_batch=2),
                                         DevicePlan(rank=1, device="cpu1", speed=1.0, share=10, micro_batch=5)))


def worker(rank, world, num_workers, faults=None):
    import hetrain

    ht = hetrain.init(global_batch=B, max_steps=STEPS, num_workers=num_workers, plan=plan(),
                      reporting=Reporting(verbose=False), **({"emulation": Emulation(cluster="a100-80g,rtx3090", faults=faults)} if faults else {}))
    net = model()
    net, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), Pids())
    readers, indices = set(), []
    for step in batches:
        for mb in step:
            with mb:
                x, y, pids = mb.batch
                readers.update(pids.tolist())
                ht.backward(F.mse_loss(net(x), y))
        indices.append(list(step.indices))
        ht.step()
    params = [p.detach().clone() for p in net.parameters()]
    micro = ht.plan.devices[0].micro_batch
    ht.close()
    return {"params": params, "readers": readers, "me": os.getpid(), "indices": indices, "micro": micro}


def reference(indices_by_rank):
    """One process over each step's samples, rank 0's then rank 1's (the global batch's order)."""
    ds, net = Pids(), model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in zip(*indices_by_rank):
        ids = [i for part in step for i in part]
        x, y = ds.x[ids], ds.y[ids]
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()]


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


OOM = "oom:rank=0,step=2,micro=1,phase=backward"


def every_case(rank, world, ports):
    """The three jobs in turn, in one set of processes: read by 2 workers, in the process, and by 2
    workers through an OOM that cuts rank 0's micro-batches. Each job on a port of its own: a job's
    persistent workers, forked from rank 0, hold its store's listening socket until they exit."""
    out = {}
    for name, args, port in zip(("workers", "in_process", "oom"), ((2,), (0,), (2, OOM)), ports):
        os.environ["MASTER_PORT"] = str(port)
        out[name] = worker(rank, world, *args)
    return out


@pytest.fixture(scope="module")
def runs():
    from harness import free_port

    results = run_ranks(every_case, 2, [free_port() for _ in range(3)])
    return {k: [r[k] for r in results] for k in results[0]}


def test_workers_read_each_ranks_micro_batches_to_the_weights_of_one_process(runs):
    with_workers, in_process = runs["workers"], runs["in_process"]
    want = reference([r["indices"] for r in with_workers])
    for w, p in zip(with_workers, in_process):
        assert w["indices"] == p["indices"]
        assert max_diff(w["params"], want) < 1e-12 and max_diff(w["params"], p["params"]) == 0.0
        assert w["me"] not in w["readers"] and len(w["readers"]) >= 1     # read by worker processes
        assert p["readers"] == {p["me"]}                                  # num_workers=0: this process


def test_an_oom_that_cuts_the_micro_batches_reads_the_redo_through_the_workers(runs):
    want = reference([r["indices"] for r in runs["oom"]])
    for r in runs["oom"]:
        assert max_diff(r["params"], want) < 1e-12
        assert r["me"] not in r["readers"] and r["micro"] == 1      # rank 0's micro-batches cut from 2 to 1


def test_a_negative_worker_count_is_one_line():
    import hetrain
    from hetrain.errors import UsageError

    with pytest.raises(UsageError) as e:
        hetrain.init(global_batch=B, num_workers=-1)
    assert "num_workers=-1" in e.value.what and "worker processes" in e.value.fix
