"""The sync probe never leaves a rank in a collective its peers skipped: the user's forward
failing on rank 1 alone, inside the probe (after profiling, which calls it on the bare model,
succeeded), raises the same HetrainError on every rank, naming rank 1 and the cause, with no
hang (the harness deadline is far below the job's collective timeout). Beside each DDP run it
times the bare module (what ddp_cost is read from), and leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist


def worker(rank, world):
    import hetrain
    from hetrain.errors import HetrainError
    from torch.nn.parallel import DistributedDataParallel as DDP

    calls = {"bare": 0}

    def forward(model, batch):
        if isinstance(model, DDP):
            if rank == 1:
                raise RuntimeError("the forward broke on the wrapped model")
        else:
            calls["bare"] += 1
        x, y = batch
        return F.mse_loss(model(x), y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    ht = hetrain.init(global_batch=8, max_steps=1, emulation=Emulation(cluster="a100-80g,rtx3090"),
                      reporting=Reporting(verbose=False), timeout_s=600)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ht.prepare(model, opt, torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), forward=forward)
    except HetrainError as e:
        return {"error": type(e).__name__, "what": e.what, "profiled": calls["bare"]}
    return {"error": None}


def test_a_forward_failing_on_one_rank_in_the_sync_probe_raises_on_every_rank():
    r0, r1 = run_ranks(worker, 2, timeout=90)     # the job's collectives would wait 600 s
    assert r0["error"] == r1["error"] == "HetrainError"
    assert r0["what"] == r1["what"]
    assert "rank 1: RuntimeError: the forward broke on the wrapped model" in r0["what"]
    assert "rank 0" not in r0["what"]
    assert r0["profiled"] > 0 and r1["profiled"] > 0       # profiling ran the same forward, and passed


def bare_beside_ddp(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetrain.runtime.measure.sync_probes import time_gradient_sync

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1))
        before = {n: t.detach().clone() for n, t in model.state_dict().items()}
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))
        rng = torch.get_rng_state()
        exposed, through_ddp, bare, ddp_over_bare = time_gradient_sync(
            DDP(model), (x, x.sum(1, keepdim=True)), forward=lambda m, b: F.mse_loss(m(b[0]), b[1]),
            device=torch.device("cpu"), runs=3)
        return {"exposed": exposed, "ddp": through_ddp, "bare": bare, "ratio": ddp_over_bare,
                "grads": [p.grad for p in model.parameters()], "rng": torch.equal(rng, torch.get_rng_state()),
                "same": all(torch.equal(before[n], t) for n, t in model.state_dict().items())}
    finally:
        dist.destroy_process_group()


def test_the_sync_probe_times_the_bare_module_beside_each_ddp_run_and_leaves_the_model_as_found():
    for r in run_ranks(bare_beside_ddp, 2, timeout=90):
        assert len(r["exposed"]) == len(r["ddp"]) == len(r["bare"]) == len(r["ratio"]) == 3
        assert all(t > 0 for t in r["ddp"] + r["bare"] + r["ratio"])   # every run timed, both ways
        # parameters, BatchNorm's running statistics, gradients and the RNG as they were
        assert r["same"] and r["rng"] and all(g is None for g in r["grads"])
