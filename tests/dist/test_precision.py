"""Per-device precision across real processes: an emulated A100 (bf16) beside an emulated V100
(fp16, no bf16 hardware) keep ONE loss scale; an overflow found on one rank only skips the step on
every rank, counted; a precision a device cannot run is one agreed error, or a named fallback.

fp16 autocast is real but ~30x slower on this CPU, hence the tiny model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N, D, H = 64, 8, 16
CLUSTER = "a100-80g,v100-32g:1.0"      # compute capability 8.0 and 7.0; speed 1: no device sleeps


def make_plan() -> Plan:
    # uneven shares; the V100 runs three micro-batches, the A100 one
    return Plan(global_batch=16, devices=(
        DevicePlan(rank=0, device="a100", speed=1.0, share=10, micro_batch=10),
        DevicePlan(rank=1, device="v100", speed=0.42, share=6, micro_batch=2)))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)


def model_for():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, 1))


class RecordingSGD(torch.optim.SGD):
    """Keeps the gradients each real (not skipped) step applied: after unscaling."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.applied = []

    def step(self, closure=None):
        self.applied.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def train_worker(rank, world, inject_at, agreed):
    import hetrain

    x, y = data()
    ht = hetrain.init(global_batch=16, plan=make_plan(), emulation=Emulation(cluster=CLUSTER),
                      reporting=Reporting(verbose=False), precision="auto", max_steps=3)
    warnings = []
    ht.log.warn = ht.log.warn_job = warnings.append
    model = model_for()
    opt = RecordingSGD(model.parameters(), lr=0.1)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y))
    if not agreed:   # the guard: a per-rank scaler that does not agree on overflows
        ht.job.precision.scaler = torch.amp.GradScaler("cpu")
    out = {"indices": [], "params": [], "scales": [], "warnings": warnings}
    for step in batches:
        for mb in step:
            with mb:
                bx, by = mb.batch
                with ht.autocast():
                    loss = F.mse_loss(model(bx).float(), by)
                ht.backward(loss)
        if step.index == inject_at and rank == 1:
            # after the gradient all-reduce: only this rank sees the overflow
            next(model.module.parameters()).grad[0, 0] = float("inf")
        ht.step()
        out["indices"].append(list(step.indices))
        out["params"].append([p.detach().clone() for p in model.module.parameters()])
        out["scales"].append(ht.job.precision.scaler.get_scale())
    out["applied"] = opt.applied
    out["summary"] = ht.summary()["precision"]
    out["plan_precisions"] = [d.precision for d in ht.plan.devices]
    ht.close()
    return out


def reference_first_grads(indices):
    x, y = data()
    model = model_for()
    idx = torch.tensor(indices)
    F.mse_loss(model(x[idx]), y[idx]).backward()
    return [p.grad for p in model.parameters()]


def cases_worker(rank, world):
    """Every case of this file in one process group, one job after the other."""
    from pipeline_runs import join_group

    join_group()
    return {"agreed": train_worker(rank, world, 1, True), "per_rank_scalers": train_worker(rank, world, 1, False),
            "bf16 forced": bad_precision_worker(rank, world)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(cases_worker, 2)


def test_mixed_bf16_fp16_one_loss_scale_and_overflow_on_one_rank_skips_everywhere(runs):
    r0, r1 = (r["agreed"] for r in runs)
    # per-device precision from the catalog GPU: bf16 on the A100, fp16 on the V100
    assert r0["summary"]["per_rank"] == ["bf16", "fp16"] == r0["plan_precisions"]
    # one loss scale for the job, on every rank, at every step (scaled on the bf16 rank too)
    assert r0["scales"] == r1["scales"]
    assert r0["scales"] == [65536.0, 32768.0, 32768.0]
    # step 0 ran: its gradients, unscaled, are the big-batch gradient (to autocast precision)
    indices0 = r0["indices"][0] + r1["indices"][0]
    ref = reference_first_grads(indices0)
    for r in (r0, r1):
        for got, want in zip(r["applied"][0], ref):
            assert torch.allclose(got, want, rtol=2e-2, atol=2e-3), (got - want).abs().max()
    # step 1: the inf was on rank 1 only, yet both ranks skipped it and counted it
    for r in (r0, r1):
        assert len(r["applied"]) == 2                          # steps 0 and 2 stepped
        assert all(torch.equal(a, b) for a, b in zip(r["params"][1], r["params"][0]))
        assert not all(torch.equal(a, b) for a, b in zip(r["params"][2], r["params"][1]))
        assert r["summary"]["skipped_steps"] == 1 and r["summary"]["skipped_at"] == [1]
        assert any("step 1" in w and "skipped on every rank" in w for w in r["warnings"])
    assert all(torch.equal(a, b) for a, b in zip(r0["params"][2], r1["params"][2]))


def test_guard_without_agreement_the_ranks_diverge(runs):
    """The test above can fail: with per-rank scalers that do not agree, rank 0 steps where
    rank 1 skips, and the replicas drift apart."""
    r0, r1 = (r["per_rank_scalers"] for r in runs)
    assert len(r0["applied"]) == 3 and len(r1["applied"]) == 2
    assert not all(torch.equal(a, b) for a, b in zip(r0["params"][2], r1["params"][2]))


def bad_precision_worker(rank, world):
    import hetrain
    from hetrain.errors import UsageError

    x, y = data()
    first = hetrain.init(global_batch=16, plan=make_plan(), emulation=Emulation(cluster=CLUSTER),
                         reporting=Reporting(verbose=False), precision="bf16")
    try:
        first.prepare(model_for(), torch.optim.SGD(model_for().parameters(), lr=0.1),
                      torch.utils.data.TensorDataset(x, y))
        refused = None
    except UsageError as e:
        refused = (e.what, e.fix)
    # the same job with the fallback allowed (joins the same process group)
    ht = hetrain.init(global_batch=16, plan=make_plan(), emulation=Emulation(cluster=CLUSTER),
                      reporting=Reporting(verbose=False), precision="bf16",
                      allow_fallback=True, max_steps=1)
    import io

    from rich.console import Console

    if ht.rank == 0:                  # what rank 0 prints: every rank's warnings, once, rank named
        ht.log.console = Console(file=io.StringIO(), width=400)
    model = model_for()
    model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.utils.data.TensorDataset(x, y))
    for step in batches:
        for mb in step:
            with mb:
                with ht.autocast():
                    ht.backward(F.mse_loss(model(mb.batch[0]).float(), mb.batch[1]))
        ht.step()
    summary = ht.summary()["precision"]
    warnings = ht.log.console.file.getvalue().splitlines() if ht.rank == 0 else []
    ht.close()
    first.close()
    return refused, warnings, summary


def test_bf16_forced_on_a_v100_is_one_agreed_error_or_a_named_fallback(runs):
    (refused0, warn0, summary0), (refused1, _, _) = (r["bf16 forced"] for r in runs)
    assert refused0 == refused1 is not None           # every rank stops with the same error
    what, fix = refused0
    assert "rank 1" in what and "v100" in what and "compute capability 7.0" in what and "rank 0" not in what
    assert "allow_fallback=True" in fix and "--allow-fallback" in fix
    assert summary0["per_rank"] == ["bf16", "fp16"]
    # rank 1's own warning, printed by rank 0 with the rank named
    assert any(w.startswith("warning (rank 1)") and "bf16 -> fp16" in w and "v100" in w for w in warn0), warn0
