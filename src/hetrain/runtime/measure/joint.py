"""What every rank measures before the job is planned, gathered so that all ranks hold all of it.

Each rank profiles its own device (runtime/measure/profiler.py, cached); all gather the profiles; with
more than one rank they then time the gradient sync and the per-step agreement together. The
result (runtime/measure/measurements.py's Measurements) is the same on every rank, and every rank turns it
into the same Plan with the pure `plan_from_measurements`, without a further exchange.

What a rank's part of the job is comes from the job record (runtime/job.py), which Engine.prepare
and `hetrain plan`'s worker (cli/plan_worker.py) both fill with setup.prepare_to_measure, so both
measure alike.

Profiling is local and never raises: a rank that fails returns its error, which every rank then
sees in the gather and raises together, instead of one rank leaving while its peers wait. The
sync probe settles its local work the same way (sync_probes.settle) before each collective.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import HetrainError, UsageError
from ...hardware.host import usable_cores
from ...hardware.units import format_bytes
from ...layout_spec import reconcile
from ...planning.plan import Plan
from ...planning.planner import KEPT_TOO_SLOW
from ..resilience.resume import REPLANNED
from ..replan import check_fits
from ..ranks import agree
from .measurements import Measurements, profiles_come_from
from .profiler import MAX_SIZE, profile_device
from ..devices.cuda_memory import usable_bytes
from .sync_probes import settle, time_agreement, time_allreduce, time_gradient_sync, time_inter_node_allreduce

if TYPE_CHECKING:
    from ..job import Job

SYNC_RUNS = 5          # synchronised backwards the sync probe times on GPUs (NCCL: little noise)
# On a shared CPU (gloo, devices that are threads of one host) the same probe also gives the
# stragglers and the slowdown of computing at once that the plan predicts with, and its runs
# scatter: in 4 60-step demos each, on a 2-core AMD EPYC VM, 5 runs predicted samples/s 3.5-13.4%
# off (that slowdown read 1.08-1.37), 15 runs 0.1-9.6% off (1.19-1.31), for about 2 s more at
# start-up. What is left is mostly the host's own drift (a fixed matmul loop there varied 17%
# between 2 s windows).
CPU_SYNC_RUNS = 15


def sync_runs(backend: str) -> int:
    """How many runs the sync probe times: the same on every rank (it is a collective), as the
    backend is."""
    return SYNC_RUNS if backend == "nccl" else CPU_SYNC_RUNS


def measure_job(job: Job, model, optimizer, forward) -> Measurements:
    """Every rank's measurements, the same on every rank. A collective: every rank calls it."""
    mine = _profile(job, model, optimizer, forward)
    gathered = [mine]
    if job.world_size > 1:
        gathered = [None] * job.world_size
        dist.all_gather_object(gathered, mine)
    for rank, g in enumerate(gathered):
        if g["error"] is not None:
            kind, what, fix, usage = g["error"]
            raise (UsageError if usage else HetrainError)(
                f"rank {rank} ({job.hooks.measuring().label_note}device) could not be profiled: "
                f"{kind}: {what}", fix or "see the error above; pass hetrain.init(plan=...) to skip profiling")
    facts = {"labels": tuple(g["label"] for g in gathered), "precisions": tuple(g["precision"] for g in gathered),
             "grad_bytes": gathered[0]["grad_bytes"], "cpu_cores": gathered[0]["cpu_cores"],
             "grad_shapes": tuple(tuple(s) for s in gathered[0]["grad_shapes"]), "backend": job.ctx.backend,
             "n_params": gathered[0]["n_params"], "n_trainable": gathered[0]["n_trainable"],
             "nodes": job.nodes.count if job.nodes is not None else 1}
    if gathered[0]["profile"] is None:      # a single device with unlimited memory
        return Measurements(profiles=None, **facts)
    profiles = tuple(g["profile"] for g in gathered)
    probes = _probe(job, model, facts["grad_bytes"], profiles, forward) if job.world_size > 1 else {}
    measured = Measurements(profiles=profiles, cached=tuple(bool(g["cached"]) for g in gathered),
                            **facts, **probes)
    job.log.detail(profiles_come_from(measured))
    return measured


def _profile(job: Job, model, optimizer, forward) -> dict:
    """This rank's profile (runtime/measure/profiler.py, cached). Local: no collective."""
    cfg, measuring = job.config, job.hooks.measuring()
    mine: dict = {"profile": None, "cached": False, "error": None, "label": job.device_label, "precision": job.precision.name,
                  "cpu_cores": usable_cores(),
                  "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                  # what planning/compression.py predicts PowerSGD's bytes from
                  "grad_shapes": [list(p.shape) for p in model.parameters() if p.requires_grad],
                  "n_params": sum(p.numel() for p in model.parameters()),
                  "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    cap = measuring.memory_bytes(usable_bytes(job.device) if job.device.type == "cuda" else None)
    if job.world_size == 1 and cap is None:
        return mine          # one device, memory not limited: nothing to decide or measure
    n = len(job.dataset)
    try:
        mine["profile"], mine["cached"] = profile_device(
            model, optimizer, lambda m: job.load(range(min(m, n))), device=job.device, label=job.device_label,
            forward=forward, precision=job.precision.compute, memory_bytes=cap,
            max_size=max(1, min(MAX_SIZE, cfg.global_batch, n)), measuring=measuring)
    except Exception as e:     # noqa: BLE001 — reported on every rank after the gather
        mine["error"] = (type(e).__name__, getattr(e, "what", str(e)), getattr(e, "fix", None),
                         isinstance(e, UsageError))
    return mine


def _probe(job: Job, model, grad_bytes: int, profiles, forward) -> dict:
    """The sync probe's table and the agreement probe, once every rank is known to be profiled.
    A collective. What can fail on one rank alone is settled on all before the next collective
    (sync_probes.settle): every rank raises the same error, none is left waiting."""
    runs = sync_runs(job.ctx.backend)
    mine = _measure_sync(job, model, grad_bytes, profiles, forward, runs=runs)
    table = agree.exchange(mine, rank=job.rank, world_size=job.world_size, device=job.device)
    # Every rank is known to be here: the step's agreement all-reduce, timed.
    agreement = agree.exchange({"agree_s": time_agreement(job.device)}, rank=job.rank,
                               world_size=job.world_size, device=job.device)
    rows = [table.row(r) for r in range(job.world_size)]
    inter = {"inter_node_s": max(table.column("inter_node_s"))} if "inter_node_s" in rows[0] else {}
    return {**inter, "allreduce_s": tuple(table.column("allreduce_s")),
            "sync_s": tuple(tuple(row[f"sync_{k}"] for k in range(runs)) for row in rows),
            "compute_s": tuple(tuple(row[f"compute_{k}"] for k in range(runs)) for row in rows),
            "plain_compute_s": tuple(tuple(row[f"plain_{k}"] for k in range(runs)) for row in rows),
            "ddp_over_bare": tuple(tuple(row[f"ddp_cpu_{k}"] for k in range(runs)) for row in rows),
            "agree_s": tuple(agreement.column("agree_s")), "probe_size": int(max(table.column("probe_size")))}


def _measure_sync(job: Job, model, grad_bytes, profiles, forward, *, runs: int) -> dict[str, float]:
    """Collectives: one gradient-sized all-reduce (the link; on a job of several nodes also one
    among the nodes' leaders only: the inter-node link) and `runs` synchronised backwards
    through DDP (the sync this job leaves exposed, and each rank's compute before it; every rank
    on the same micro-batch size). The DDP used for it is temporary: the real wrapper
    (runtime/sharding/wrap.py) is chosen after the plan. The probe batch is loaded first, locally,
    and settled on every rank before any of them."""
    cfg, n = job.config, len(job.dataset)
    caps = [p.max_micro_batch(margin=cfg.memory.margin) for p in profiles]
    m = max(1, min([cfg.global_batch // job.world_size, n, MAX_SIZE] + [max(1, c // 2) for c in caps if c]))
    error = batch = None
    try:
        batch = job.load(range(m))
    except Exception as e:     # noqa: BLE001 — settled on every rank just below
        error = e
    settle(error, stage="loading the probe batch", device=job.device)
    probe_bytes = min(grad_bytes, 64 * 1024**2)     # a larger gradient is costed at this bandwidth
    scale = grad_bytes / max(probe_bytes, 1)
    measuring = job.hooks.measuring()
    link = measuring.link(job)                      # what the collectives cross beyond the transport, if anything
    allreduce_s = time_allreduce(probe_bytes, job.device, link=link) * scale
    inter = {}
    nodes = job.nodes
    if nodes is not None and nodes.spans_nodes:     # the link between the nodes, alone (one node: not run)
        inter["inter_node_s"] = time_inter_node_allreduce(
            probe_bytes, job.device, leaders=nodes.leaders, rank=job.rank, timeout_s=cfg.timeout_s,
            link=measuring.link(job, ring=nodes.count)) * scale
    ddp = DDP(model, device_ids=[job.device.index] if job.device.type == "cuda" else None)
    try:
        syncs, computes, plain, ratios = time_gradient_sync(ddp, batch, forward=forward, device=job.device,
                                                            precision=job.precision.compute, runs=runs, link=link)
    finally:
        del ddp
        gc.collect()
    return {**inter, **_sync_row(allreduce_s, syncs, computes or [0.0] * runs, plain or [0.0] * runs,
                                 ratios or [0.0] * runs, probe_size=m)}


def _sync_row(allreduce_s: float, syncs, computes, plain, ratios, *, probe_size: int) -> dict[str, float]:
    """This rank's row of the sync probe's table."""
    return {"allreduce_s": allreduce_s, "probe_size": float(probe_size),
            **{f"sync_{k}": v for k, v in enumerate(syncs)},
            **{f"compute_{k}": v for k, v in enumerate(computes)},
            **{f"plain_{k}": v for k, v in enumerate(plain)},
            **{f"ddp_cpu_{k}": v for k, v in enumerate(ratios)}}


def read_plan_file(path: str | None) -> Plan | None:
    """The Plan saved at `path` (`hetrain plan --out`), or None without a path."""
    if path is None:
        return None
    try:
        with open(path) as f:
            return Plan.from_json(f.read())
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"cannot read the plan {path!r}: {e}",
                         "pass a file written by `hetrain plan --out`, or no plan") from None


def check_given_plan(job, plan: Plan, *, layout=None) -> Plan:
    """The given plan, when it is for this job: its world size, global batch and, with `layout`
    (the layout object that runs it), its layout (layout_spec.reconcile: one line naming both)."""
    if layout is not None:
        reconcile(plan.layout_record(), layout, world_size=job.world_size)
    check_fits(job, plan)
    return plan


def show_plan(log, plan: Plan, total_steps: int, *, computes: dict[str, str] | None = None) -> None:
    """The plan as a person reads it before training: one table and one summary line, plus the
    reason a user can act on (a device kept that slows the job); every other reason and note under
    Reporting.details (`--verbose`), as `hetrain plan` prints them all. `computes`: device label ->
    what it computes in, where that differs from its card's precision (a card computing on a slow CPU)."""
    computes = computes or {}
    rows = []
    for d in plan.devices:
        sizes = d.micro_sizes()
        micro = f"{sizes[0]}" + (f" x{len(sizes)}" if len(sizes) > 1 else "")
        precision = d.precision + (f" (computes {computes[d.device]})" if d.device in computes else "")
        memory = "-" if not d.predicted_memory_bytes else format_bytes(d.predicted_memory_bytes) + (
            f" of {format_bytes(d.memory_cap_bytes)}" if d.memory_cap_bytes else "") + (
            ", checkpointing" if d.checkpointing else "")
        rows.append((d.rank, d.device, f"{d.speed:.3g}", d.share, micro, precision, memory))
    log.table(f"plan v{plan.version}: global batch {plan.global_batch} over {plan.world_size} device(s), "
              f"{total_steps} steps", ("rank", "device", "speed", "share", "micro-batch", "precision",
                                       "peak memory"), rows)
    log.info(plan_summary(plan) + ("" if log.details else " (--verbose: every reason)"))
    for d in plan.devices:
        for reason in d.reasons:
            (log.info if reason.startswith(KEPT_TOO_SLOW) else log.detail)(f"  rank {d.rank}: {reason}")
    for line in filter(None, plan.note.split("; ")):
        (log.info if line.startswith(REPLANNED) else log.detail)(f"  plan v{plan.version}: {line}")
    for e in plan.excluded:
        log.info(f"  left out {e.device}: {e.reason}; {e.fix}")


def plan_summary(plan: Plan) -> str:
    """One line: the predicted samples/s and what bounds the step (the largest of its parts)."""
    p = plan.predicted
    rate, step = p.get("samples_per_s"), p.get("step_s")
    if not rate:
        return "predicted: no figure for this plan"
    head = f"predicted {rate:.1f} samples/s"
    parts = {name: p.get(key) or 0.0 for name, key in (
        ("compute", "compute_s"), ("gradient sync", "comm_exposed_s"), ("stragglers", "straggle_s"),
        ("agreement", "agree_s"), ("optimizer", "optimizer_s"))}
    if not step or not any(parts.values()):          # a pipeline's plan: its split table says what bounds it
        return head + (f" (a {step * 1e3:.1f} ms step)" if step else "")
    bound = max(parts, key=parts.get)
    if bound == "compute" and plan.devices:
        slowest = max(plan.devices, key=lambda d: d.predicted_compute_s or 0.0)
        bound += f" on {slowest.device}"
    shares = ", ".join(f"{v / step:.0%} {name}" for name, v in parts.items() if v / step >= 0.005)
    return f"{head}, bound by {bound}: a {step * 1e3:.1f} ms step is {shares}"
