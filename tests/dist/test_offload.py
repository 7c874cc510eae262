"""Optimizer-state offload on real gloo ranks: the same training as a single process stepping the
whole global batch (float64, within 1e-12), on one rank or both, under sharding none, fsdp and
capacity-full; a resume equal to the uninterrupted run; the emulated meter's peak lower by the
state's bytes; and the one-line refusals (no host room, a plan needing offload under 'never', a
layout it does not run under).

Reference: one process, no hetrain, AdamW on the concatenation of every rank's samples of each step.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from nets import BlockNet
from hetrain import Checkpoints, Memory, Rebalancing, Reporting
from hetrain.emulation import Emulation
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = pytest.mark.dist

N, D = 192, 8
PAIR = "a100-80g@64MiB,rtx3090:1.0@24MiB"     # the plans are given: at speed 1 no emulated device sleeps
STEPS = 3
GAMMA = 0.7        # the resume's LR schedule: each step's rate differs, so a lost one shows


def make_plan(offload=(False, False), shares=(24, 40), micros=(8, 40), names=("cpu0", "cpu1")) -> Plan:
    return Plan(global_batch=sum(shares), devices=tuple(
        DevicePlan(rank=r, device=name, speed=1.0, share=s, micro_batch=m, offload_optimizer=o)
        for r, (name, s, m, o) in enumerate(zip(names, shares, micros, offload))))


def data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(N, D, generator=g, dtype=torch.float64),
            torch.randn(N, 1, generator=g, dtype=torch.float64))


def net():
    torch.manual_seed(0)
    return BlockNet(D, 16, 3).double()


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def job(plan, steps, *, sharding="none", memory=None, checkpoints=None, patch_host=None, cluster=PAIR,
        schedule=False):
    from hetrain.runtime.memory import offload

    if patch_host is None:
        return _job(plan, steps, sharding=sharding, memory=memory, checkpoints=checkpoints, cluster=cluster,
                    schedule=schedule)
    measured = offload.host_available_bytes
    offload.host_available_bytes = lambda: patch_host
    try:
        return _job(plan, steps, sharding=sharding, memory=memory, checkpoints=checkpoints, cluster=cluster,
                    schedule=schedule)
    finally:       # the next job in this process measures the host again
        offload.host_available_bytes = measured


def _job(plan, steps, *, sharding, memory, checkpoints, cluster, schedule):
    import hetrain
    from hetrain.errors import UsageError
    from hetrain.runtime.memory.activation_checkpointing import is_checkpointed

    x, y = data()
    model = net()
    ht = hetrain.init(global_batch=plan.global_batch, plan=plan, max_steps=steps,
                      precision="fp32", emulation=Emulation(cluster=cluster), reporting=Reporting(verbose=False),
                      rebalancing=Rebalancing(enabled=False), timeout_s=60, memory=memory or Memory(),
                      checkpoints=checkpoints or Checkpoints())
    lines = []
    ht.log.info = lines.append
    try:
        model, opt, batches = ht.prepare(model, adamw(model.parameters()), torch.utils.data.TensorDataset(x, y),
                                         parallel=hetrain.DataParallel(sharding=None if sharding == "auto" else sharding))
    except UsageError:
        ht.close()          # a refusal leaves no job behind: the next one joins the same process group
        raise
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=GAMMA) if schedule else None
    if scheduler is not None:
        ht.register_state("schedule", scheduler)
    out = {"indices": [], "lines": lines, "offload": [d.offload_optimizer for d in ht.plan.devices],
           "checkpointed": [is_checkpointed(b) for b in model.module.blocks]}
    for step in batches:
        for mb in step:
            with mb:
                bx, by = mb.batch
                ht.backward(F.mse_loss(model(bx), by))
        out["indices"].append(list(step.indices))
        ht.step()
        if scheduler is not None:
            scheduler.step()
    if hasattr(opt, "sharding"):
        out["params"] = opt.sharding.full_parameters()
        stepping = opt.optim
    else:
        out["params"] = {n: full(p) for n, p in model.module.named_parameters()}
        stepping = opt
    out["host_bytes"] = stepping.host_bytes() if hasattr(stepping, "host_bytes") else 0
    out["strategy"] = ht.job.memory_plan.strategy
    out["memory"] = ht.summary()["memory"]
    ht.close()
    return out


def reference(step_indices, schedule=False):
    x, y = data()
    model = net()
    opt = adamw(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=GAMMA) if schedule else None
    for idx in step_indices:
        idx = torch.tensor(idx)
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def steps_of(records):
    out = [sum((r["indices"][s] for r in records), []) for s in range(len(records[0]["indices"]))]
    assert all(len(i) == len(set(i)) for i in out)
    return out


SHARDINGS = ("none", "fsdp", "capacity-full")
ALL, CUT = 4, 2      # the resumed jobs: saved every CUT steps of ALL, resumed after step CUT


def refused(plan, sharding, memory, host):
    from hetrain.errors import UsageError

    try:
        job(plan, 1, sharding=sharding, memory=memory, patch_host=host)
    except UsageError as e:
        assert e.exit_code == 2
        return str(e)
    return None


def save_job(rank, root, sharding):
    import torch.distributed as dist

    out = job(make_plan((False, True)), ALL, sharding=sharding, checkpoints=Checkpoints(dir=f"{root}/{sharding}", every=CUT),
              schedule=True)
    if rank == 0:                    # as if the job had died after saving step CUT
        shutil.rmtree(f"{root}/{sharding}/step-{ALL:08d}")
    dist.barrier()
    return out


def resume_job(root, sharding):
    return job(make_plan((False, True)), ALL, sharding=sharding, checkpoints=Checkpoints(dir=f"{root}/{sharding}", every=CUT),
               schedule=True)


# each: the plan, sharding, Memory, the host's free bytes (None: as measured) and words of the one line
REFUSALS = [(make_plan(), "none", Memory(offload_optimizer="always"), 1024, ("needs",)),
            # a plan that needs offload under 'never': the rank and its device named, and the fix
            (make_plan((False, True), names=("a100-80g#0", "rtx3090#1")), "none", Memory(offload_optimizer="never"),
             None, ("'never'", "rank 1 (rtx3090#1)", "offload_optimizer='never'", "offload_optimizer='auto'")),
            (make_plan((True, False)), "zero1", None, None, ("sharding 'zero1'",))]


def cases_worker(rank, world, root):
    """Every job of this file but the resumes, one after the other in one process group."""
    from pipeline_runs import join_group

    join_group()
    out = {}
    for sharding in SHARDINGS:
        out["rank 1", sharding] = job(make_plan((False, True)), STEPS, sharding=sharding)
        out["both", sharding] = job(make_plan((False, True)), STEPS, sharding=sharding,
                                    memory=Memory(offload_optimizer="always"))
    out["blocks"] = job(Plan(global_batch=64, devices=tuple(replace(d, checkpointing=True, checkpoint_blocks=k)
                                                            for d, k in zip(make_plan((False, True)).devices, (2, None)))),
                        STEPS)
    small = "a100-80g@64MiB,rtx3090:1.0@48KiB"
    out["auto sharded"] = job(make_plan(), STEPS, sharding="auto", cluster=small)
    out["auto offloaded"] = job(make_plan((False, True)), STEPS, sharding="auto", cluster=small)
    out["kept"] = job(make_plan(), STEPS)
    for sharding in SHARDINGS:
        out["saved", sharding] = save_job(rank, root, sharding)
    out["refused"] = [refused(plan, sharding, memory, host) for plan, sharding, memory, host, _ in REFUSALS]
    out["layouts"] = {parallel: layout_job(parallel) for parallel in ("pp", "tp")}
    return out


def resumes_worker(rank, world, root):
    """The saved jobs resumed, in processes of their own as after a restart."""
    from pipeline_runs import join_group

    join_group()
    return {sharding: resume_job(root, sharding) for sharding in SHARDINGS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: [rank 0's record, rank 1's]}, the resumes under ("resumed", sharding)."""
    root = str(tmp_path_factory.mktemp("offload"))
    results = run_ranks(cases_worker, 2, root, timeout=600)
    out = {case: [r[case] for r in results] for case in results[0]}
    resumed = run_ranks(resumes_worker, 2, root, timeout=300)
    out.update({("resumed", sharding): [r[sharding] for r in resumed] for sharding in SHARDINGS})
    return out


# -- exact math ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("where", ["rank 1", "both"])
def test_offloaded_training_equals_one_process_big_batch_float64(runs, sharding, where):
    """24/40 split (rank 0 three micro-batches, rank 1 one); rank 1 offloads by its plan, or every
    rank by Memory(offload_optimizer='always')."""
    records = runs[where, sharding]
    ref = reference(steps_of(records))
    for r in records:
        assert max_diff(r["params"], ref) <= 1e-12
        assert r["offload"] == ([False, True] if where == "rank 1" else [True, True])
    assert (records[0]["host_bytes"] > 0) == (where == "both")
    assert records[1]["host_bytes"] > 0
    said = [line for line in records[0]["lines"] if "on host" in line]   # rank 0 logs every rank's
    assert any(line.startswith("optimizer state of rank 1 on host: ") and "cpu1 24.0 MiB" in line
               for line in said), said


def test_the_plans_block_count_is_checkpointed_beside_offload_and_stays_exact(runs):
    """Rank 0 checkpoints the first 2 of its 3 blocks, rank 1 every block and offloads."""
    records = runs["blocks"]
    assert [r["checkpointed"] for r in records] == [[True, True, False], [True, True, True]]
    ref = reference(steps_of(records))
    for r in records:
        assert max_diff(r["params"], ref) <= 1e-12


def test_auto_sharding_counts_the_offloaded_state_off_the_device(runs):
    """On a 48 KiB card the unsharded state and activations (54 KiB) do not fit, so sharding='auto'
    shards; with rank 1's state on the host they fit unsharded (39 KiB), and auto stays at 'none'
    rather than picking a sharding offload does not run under."""
    sharded, offloaded = runs["auto sharded"], runs["auto offloaded"]
    assert sharded[0]["strategy"] not in ("none", "fsdp")
    assert [r["strategy"] for r in offloaded] == ["none", "none"]
    assert max_diff(offloaded[1]["params"], reference(steps_of(offloaded))) <= 1e-12


# -- checkpoints ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_resume_with_offload_equals_the_uninterrupted_run(runs, sharding):
    """Rank 1 offloads; an LR schedule registered with the job: the host optimizer's state and
    hyperparameters both come back."""
    saved, resumed = runs["saved", sharding], runs["resumed", sharding]
    for s, r in zip(saved, resumed):
        assert len(r["indices"]) == ALL - CUT
        assert max_diff(r["params"], s["params"]) <= 1e-12
    assert max_diff(saved[0]["params"], reference(steps_of(saved), schedule=True)) <= 1e-12


# -- the emulated meter ------------------------------------------------------------------------------
def test_the_offloading_rank_peaks_lower_by_its_optimizer_state(runs):
    """AdamW holds exp_avg and exp_avg_sq, two float64 values a parameter: that many bytes leave
    the emulated device of rank 1 (within 1%: the meter counts storages, the figure elements),
    and rank 0, which keeps its state, peaks as before."""
    without, offloaded = runs["kept"], runs["rank 1", "none"]
    state = 2 * 8 * sum(p.numel() for p in net().parameters())
    before, after = without[0]["memory"], offloaded[0]["memory"]
    drop = before[1]["measured"] - after[1]["measured"]
    assert abs(drop - state) <= 0.01 * state, (drop, state)
    assert after[0]["measured"] == before[0]["measured"]
    assert offloaded[1]["host_bytes"] >= state                      # the host holds it (and the copies)
    assert after[1]["host"] == offloaded[1]["host_bytes"] and after[0]["host"] == 0    # the table's 'on host'
    assert after[1]["planned"] == before[1]["planned"] - state      # the plan counts no state on the device


# -- refusals ----------------------------------------------------------------------------------------
def test_no_host_room_and_never_and_other_layouts_are_refused_in_one_line(runs):
    """Each a UsageError every rank raises alike in prepare, before training: under `hetrain run`
    the launcher's one line and exit 2 (tests/cli/test_malformed_inputs.py: prepare's errors)."""
    for k, (_, _, _, host, words) in enumerate(REFUSALS):
        errors = [r[k] for r in runs["refused"]]
        assert errors[0] == errors[1] and errors[0] is not None, errors       # every rank alike
        assert "\n" not in errors[0] and all(w in errors[0] for w in words), errors[0]
        if host is not None:
            assert "available" in errors[0] and "1.0 KiB" in errors[0], errors[0]


def layout_job(parallel):
    import hetrain
    from hetrain.errors import UsageError

    x, y = data()
    ht = hetrain.init(global_batch=16, max_steps=1, precision="fp32", emulation=Emulation(cluster=PAIR),
                      reporting=Reporting(verbose=False), memory=Memory(offload_optimizer="always"), timeout_s=60)
    torch.manual_seed(0)
    model = (torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                 torch.nn.Linear(16, 1)).double() if parallel == "pp" else
             BlockNet(D, 16, 2, block=lambda h: torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.Tanh(),
                                                                     torch.nn.Linear(2 * h, h))).double())
    try:
        ht.prepare(model, adamw(model.parameters()), torch.utils.data.TensorDataset(x, y), parallel=parallel,
                   loss_fn=F.mse_loss)
    except UsageError as e:
        return str(e)
    finally:
        ht.close()
    return None


@pytest.mark.parametrize("parallel", ["pp", "tp"])
def test_offload_under_a_pipeline_or_tensor_parallelism_is_refused_naming_where_it_runs(runs, parallel):
    errors = [r[parallel] for r in runs["layouts"]]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    named = {"pp": "Pipeline(", "tp": "TensorParallel("}[parallel]
    assert f"this job runs {named}" in errors[0] and "sharding='none' | 'fsdp'" in errors[0], errors[0]
