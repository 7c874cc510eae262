"""What differs between the torch releases hetrain runs on (2.11 to 2.14), shown on the installed one
with the newer parts taken away or the older checks put back; and the communicators a probe makes.

  * FSDP2 and capacity sharding with an OOM recovered in-loop, on a torch without
    `all_gather_single` / `reduce_scatter_single` (2.11, 2.12): those names removed here.
  * A pipeline stage's stand-in output after an OOM is shaped like its real outputs (shape, dtype,
    strides): torch 2.11 checks every stage's output against the agreed shapes, the last's included.
  * The pipeline probe makes its one-rank group once, not on every call.
  * An exit without close() on NCCL aborts the communicators instead of destroying them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from nets import BlockNet, Residual
from hetrain import Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N = 48
CLUSTER = "a100-80g,rtx3090:1.0"      # the plans are given: at speed 1 no emulated device sleeps


def sharded_worker(rank, world, sharding, as_2_11):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    import hetrain

    if as_2_11 and hasattr(FSDPModule, "reset_iter_state"):          # as torch 2.11 is
        delattr(FSDPModule, "reset_iter_state")
    elif not as_2_11:      # as torch 2.11 and 2.12 are (but FSDP2's own default collectives are this torch's)
        for name in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, name):
                delattr(dist, name)
    recovers = sharding != "fsdp" or hasattr(FSDPModule, "reset_iter_state")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g, dtype=torch.float64), torch.randn(N, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    net = BlockNet().double()
    from hetrain.planning.plan import DevicePlan, Plan

    plan = Plan(global_batch=16, devices=(DevicePlan(rank=0, device="cpu0", speed=1.0, share=8, micro_batch=4),
                                          DevicePlan(rank=1, device="cpu1", speed=1.0, share=8, micro_batch=8)))
    ht = hetrain.init(global_batch=16, plan=plan, max_steps=3, precision="fp32",
                      emulation=Emulation(cluster=CLUSTER,
                                          faults="oom:rank=1,step=1,micro=0,phase=backward" if recovers else None),
                      reporting=Reporting(verbose=False), rebalancing=Rebalancing(enabled=False))
    net, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
                                   parallel=hetrain.DataParallel(sharding=sharding))
    losses = []
    for step in batches:
        for mb in step:
            with mb:
                bx, by = mb.batch
                ht.backward(F.mse_loss(net(bx), by))
        losses.append(ht.step().loss)
    summary = ht.summary()
    out = {"losses": losses, "ooms": [r["ooms"] for r in summary["ranks"]], "guard": type(ht.job.guard).__name__,
           "template": len(getattr(ht.job.guard, "template", None) or ()), "recovers": recovers,
           "recovery": ht.job.config.memory.oom_recovery}
    ht.close()
    return out


def shardings_worker(rank, world, as_2_11):
    """As torch 2.12 (fsdp, then capacity, in one process group), or as 2.11 (fsdp)."""
    from pipeline_runs import join_group

    join_group()
    return {s: sharded_worker(rank, world, s, as_2_11) for s in (("fsdp",) if as_2_11 else ("fsdp", "capacity"))}


@pytest.fixture(scope="module")
def as_torch():
    """{as_2_11: {sharding: [rank 0's, rank 1's]}}: one launch for each torch taken away."""
    out = {}
    for as_2_11 in (False, True):
        results = run_ranks(shardings_worker, 2, as_2_11, timeout=240)
        out[as_2_11] = {s: [r[s] for r in results] for s in results[0]}
    return out


@pytest.mark.parametrize("sharding, as_2_11", [("fsdp", False), ("capacity", False), ("fsdp", True)])
def test_sharded_steps_and_their_oom_recovery_run_without_the_2_13_collectives(as_torch, sharding, as_2_11):
    """On torch 2.11 and 2.12 every FSDP job failed at its first step: the OOM guard's recording
    collectives called dist.all_gather_single, which came in 2.13. Without FSDP2's
    reset_iter_state (2.11) in-loop OOM recovery under FSDP2 is off, and the job trains."""
    r0, r1 = as_torch[as_2_11][sharding]
    if r0["recovers"] and sharding == "fsdp":      # the recording collectives ran: prepare() learnt the step's
        assert r0["guard"] == "FSDPGuard" and r0["template"] > 0, r0
    if not r0["recovers"]:
        assert not r0["recovery"] and r0["guard"] == "NoneType" and r0["ooms"] == [0, 0], r0
    else:
        assert r0["ooms"] == r1["ooms"] == [0, 1]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 3


def stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Residual(6) for _ in range(4))).double()


def pipeline_worker(rank, world):
    import hetrain
    from hetrain.runtime.layouts.pipeline.stage import MeteredStage
    from pipeline_runs import pipeline_plan

    seen = []       # (failed, shape, dtype, stride) of every output a stage's forward returned
    forward = MeteredStage.forward_maybe_with_nosync

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append((self.failed is not None, tuple(out.shape), out.dtype, out.stride()))
        return out

    MeteredStage.forward_maybe_with_nosync = recording
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(N, 6, generator=g).double(), torch.randn(N, 6, generator=g).double())
    ht = hetrain.init(global_batch=24, max_steps=3, precision="fp32",
                      emulation=Emulation(cluster=CLUSTER, faults="oom:rank=1,step=1,micro=0,phase=forward"),
                      reporting=Reporting(verbose=False))
    net = stack()
    plan = pipeline_plan("pp", blocks=(2, 2), schedule="1f1b", shares=(24,), micro=(8,), world=2)   # 3 micro-batches
    model, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data,
                                     parallel=plan, loss_fn=F.mse_loss)
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
    ooms = [r["ooms"] for r in ht.summary()["ranks"]]
    ht.close()
    return {"seen": seen, "ooms": ooms}


def probe_and_pipeline_worker(rank, world):
    """The probe's job, then the pipeline's, one after the other in one process group."""
    from pipeline_runs import join_group

    join_group()
    return {"probe": probe_worker(rank, world), "pipeline": pipeline_worker(rank, world)}


@pytest.fixture(scope="module")
def probe_and_pipeline():
    results = run_ranks(probe_and_pipeline_worker, 2, timeout=240)
    return {name: [r[name] for r in results] for name in ("probe", "pipeline")}


def test_a_stage_s_stand_in_after_an_oom_is_shaped_like_its_outputs(probe_and_pipeline):
    """The last stage's stand-in was a 0-d zero: torch 2.11 checks every stage's forward output
    against the shapes agreed at the first step and raised PipeliningShapeError there."""
    r0, r1 = probe_and_pipeline["pipeline"]
    assert r0["ooms"] == [0, 1]
    stand_ins = {s[1:] for s in r1["seen"] if s[0]}
    real = {s[1:] for s in r1["seen"] if not s[0]}
    assert stand_ins, r1["seen"]                            # the last stage ran out of memory, and stood in
    assert stand_ins <= real, (stand_ins, real)             # shape, dtype and strides of a real output


def probe_worker(rank, world):
    import torch.distributed as dist
    from torch import nn

    import hetrain
    from hetrain.runtime.layouts.pipeline.profile import BlockCost
    from hetrain.runtime.layouts.pipeline import probe as pipeline_probe
    from hetrain.runtime.layouts.pipeline.blocks import find_parts

    ht = hetrain.init(global_batch=8, reporting=Reporting(verbose=False))
    made = []
    new_group = dist.new_group

    def counting(*args, **kwargs):
        made.append(args[0] if args else kwargs.get("ranks"))
        return new_group(*args, **kwargs)

    dist.new_group = counting
    parts = find_parts(nn.Sequential(*(nn.Linear(8, 8) for _ in range(2))))
    profile = type("Profile", (), {"blocks": [BlockCost(seconds=1e-4)]})()
    firsts = [pipeline_probe.time_stage_cost(parts, profile, torch.randn(2, 8), device=ht.device, micro_batches=2,
                                             steps=1) for _ in range(3)]
    dist.new_group = new_group
    ht.close()
    return {"made": made, "factors": [f["factor"] > 0 for f in firsts]}


def test_the_pipeline_probe_makes_its_one_rank_groups_once(probe_and_pipeline):
    """Each probe made every rank's one-rank group anew and never destroyed them: a communicator
    (GPU memory on NCCL) per rank per call, for the job's life."""
    r0, r1 = probe_and_pipeline["probe"]
    assert r0["made"] == r1["made"] == [[0], [1]]           # three probes, one set of groups
    assert all(r0["factors"]) and all(r1["factors"])


def teardown_worker(rank, world):
    import dataclasses

    import torch.distributed as dist

    import hetrain

    ht = hetrain.init(global_batch=4, reporting=Reporting(verbose=False))
    destroyed = []
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: (destroyed.append(True), destroy(*a, **k))[1]
    out = {}
    if rank == 0:       # a NCCL job (the group is gloo here: its abort runs the same path)
        ht.job.context = dataclasses.replace(ht.job.context, dist=dataclasses.replace(ht.job.ctx, backend="nccl"))
    ht._at_exit()       # as the interpreter's exit runs it after an error, close() never called
    out = {"destroyed": bool(destroyed), "initialized": dist.is_initialized()}
    dist.destroy_process_group = destroy
    return out


def test_an_exit_without_close_aborts_nccl_and_destroys_gloo():
    """On NCCL destroy_process_group after an error can wait for ever on work a lost peer never
    joins; the communicators are aborted instead. gloo's group is destroyed as before."""
    r0, r1 = run_ranks(teardown_worker, 2, timeout=120)
    assert r0 == {"destroyed": False, "initialized": False}
    assert r1 == {"destroyed": True, "initialized": False}
