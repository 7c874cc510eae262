"""LR schedulers and checkpoints under every sharding: a cosine schedule built on the optimizer
prepare() returns and registered after prepare() continues exactly after a resume (the lr of
every step and the final parameters equal an uninterrupted run), also with zero1 and capacity,
whose optimizer state every rank saves a part of (runtime/sharding/state.py); a capacity
checkpoint resumes on another world size; a scheduler registered before prepare() on the
optimizer sharding replaces is refused.

Each rank makes the process group itself, so one spawned process runs several hetrain jobs in a
row (per sharding the uninterrupted one, then one resumed from its checkpoint of step CUT)
without a new rendezvous; one spawn for all of it keeps the file cheap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from nets import BlockNet as Net
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Checkpoints, Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N, D, STEPS, CUT = 64, 8, 6, 3      # D: BlockNet's input width
# capacity sharding splits the state about 73 : 27; the plans are given: at speed 1 no emulated device sleeps
EMULATE = "a100-80g@64MiB,rtx3090:1.0@24MiB"


def make_plan(world: int) -> Plan:
    shares = (10, 6) if world == 2 else (16,)
    return Plan(global_batch=16, devices=tuple(
        DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=s, micro_batch=s // 2 if r == 0 else s)
        for r, s in enumerate(shares)))


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).tanh())


def run(world, *, sharding, steps, ckpt=None, before=False, misuse: list | None = None):
    """One hetrain job: AdamW + cosine schedule over STEPS steps. Returns (the lr each step ran
    with, the parameters at the end, whether capacity's slice bound falls inside a parameter);
    with `misuse`, appends what register_state said to misuse after the loop."""
    import hetrain

    ht = hetrain.init(global_batch=16, plan=make_plan(world), max_steps=steps,
                      precision="fp32", emulation=Emulation(cluster=",".join(EMULATE.split(",")[:world])),
                      reporting=Reporting(verbose=False), checkpoints=Checkpoints(dir=ckpt, every=CUT),
                      rebalancing=Rebalancing(enabled=False))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    if before:     # the wrong way under sharding: drives the optimizer prepare() replaces
        ht.register_state("cosine", torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS))
    model, opt, batches = ht.prepare(model, opt, dataset(), parallel=hetrain.DataParallel(sharding=sharding))
    straddles = sharding == "capacity" and any(
        bounds[1] not in _param_ends(params) for params, bounds, _ in opt.layout())
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001)
    ht.register_state("cosine", cosine)
    lrs = []
    for step in batches:
        for mb in step:
            with mb:
                xb, yb = mb.batch
                ht.backward(F.mse_loss(model(xb), yb))
        lrs.append(opt.param_groups[0]["lr"])
        ht.step()
        cosine.step()
    params = [full(p) for p in model.module.parameters()]
    if misuse is not None:
        misuse.extend(_refusals(ht, cosine))
    ht.close()
    return lrs, params, straddles


def _refusals(ht, cosine) -> list[str]:
    """What register_state says to misuse, once training started: each must be refused."""
    from hetrain.errors import UsageError

    said = []
    for name, obj in (("late", torch.optim.lr_scheduler.StepLR(cosine.optimizer, 2)), ("cosine", cosine),
                      ("no-state", object())):
        try:
            ht.register_state(name, obj)
        except UsageError as e:
            said.append(e.what)
    return said


def _param_ends(params):
    ends, at = {0}, 0
    for p in params:
        at += p.numel()
        ends.add(at)
    return ends


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


SHARDINGS = ("none", "zero1", "fsdp", "capacity")


def worker(rank, world, root):
    """For each sharding: the uninterrupted run (checkpoints at steps CUT and STEPS), then a run
    resumed from step CUT's checkpoint to the end. FSDP2's checkpoint of step CUT resumed under
    capacity sharding. Then rank 0 alone, in a group of one, resumes capacity's checkpoint of step
    CUT on one device."""
    import shutil

    import torch.distributed as dist

    from hetrain.runtime.ranks.dist import init_distributed

    init_distributed(timeout_s=60, use_cuda=False)   # the group every job below finds and uses
    out = {}
    for sharding in SHARDINGS:
        ckpt = f"{root}/{sharding}"
        reference = run(world, sharding=sharding, steps=STEPS, ckpt=ckpt)
        if rank == 0:         # resume from step CUT: as if the job had died after saving it
            shutil.rmtree(f"{ckpt}/step-{STEPS:08d}")
            if sharding in ("fsdp", "capacity"):
                shutil.copytree(ckpt, f"{root}/{sharding}-at-{CUT}")
        dist.barrier()
        resumed = run(world, sharding=sharding, steps=STEPS, ckpt=ckpt)
        out[sharding] = {"reference": reference, "resumed": resumed}
    out["misuse"] = []
    out["fsdp-to-capacity"] = run(world, sharding="capacity", steps=STEPS, ckpt=f"{root}/fsdp-at-{CUT}",
                                  misuse=out["misuse"])
    from hetrain.errors import UsageError

    try:
        run(world, sharding="zero1", steps=1, before=True)
    except UsageError as e:
        out["refused"] = f"{e.what} / {e.fix}"
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["alone"] = run(1, sharding="none", steps=STEPS, ckpt=f"{root}/capacity-at-{CUT}")
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(worker, 2, str(tmp_path_factory.mktemp("schedulers")), timeout=120)


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_cosine_schedule_resumes_exactly(runs, sharding):
    for rec in runs:
        ref_lrs, ref_params, straddles = rec[sharding]["reference"]
        lrs, params, _ = rec[sharding]["resumed"]
        assert len(set(ref_lrs)) == STEPS          # the schedule moves every step
        assert lrs == ref_lrs[CUT:]
        for got, want in zip(params, ref_params):
            assert torch.equal(got, want), (got - want).abs().max()
        if sharding == "capacity":   # the case the checkpoint gathers: a parameter's state on both ranks
            assert straddles


def test_state_registered_before_prepare_on_a_replaced_optimizer_is_refused(runs):
    for rec in runs:
        assert "holds the optimizer that prepare() replaced" in rec["refused"]
        assert "register_state('cosine', ...) after prepare()" in rec["refused"]


def test_register_state_refuses_late_twice_and_stateless(runs):
    for rec in runs:
        late, twice, stateless = rec["misuse"]
        assert "after training started" in late
        assert "twice" in twice
        assert "has no state_dict/load_state_dict" in stateless


def test_an_fsdp_checkpoint_resumes_under_capacity_sharding(runs):
    """FSDP2 saved DTensor shards of the state; capacity sharding loads each parameter's whole
    entry where its slice needs it (a parameter split over both ranks too)."""
    for rec in runs:
        ref_lrs, ref_params, _ = rec["fsdp"]["reference"]
        lrs, params, straddles = rec["fsdp-to-capacity"]
        assert straddles and lrs == ref_lrs[CUT:]
        for got, want in zip(params, ref_params):
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()


def test_capacity_checkpoint_resumes_on_one_device(runs):
    """Saved by 2 ranks whose capacity slices split a parameter; loaded by 1 (unsharded): the
    same lrs and, up to the reduction order of another world size, the same parameters as a
    single process computing every step's whole batch."""
    lrs, params, _ = runs[0]["alone"]
    assert lrs == runs[0]["capacity"]["reference"][0][CUT:]
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001)
    x, y = dataset().tensors
    from hetrain.runtime.loop.sampler import GlobalCursorSampler

    sampler = GlobalCursorSampler(N, 16, seed=0, shuffle=True, drop_last=False)
    for _ in range(STEPS):
        idx = torch.tensor(sampler.next_step().indices)
        F.mse_loss(ref(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
        cosine.step()
    for got, want in zip(params, ref.parameters()):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
