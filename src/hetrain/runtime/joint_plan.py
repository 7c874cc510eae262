"""The Plan every rank runs: each rank profiles its own device, all gather the profiles, and every
rank runs the same pure planner (planning/planner.py) on them, so all hold the same Plan without
a further exchange.

Profiling is local and never raises: a rank that fails returns its error, which every rank then
sees in the gather and raises together, instead of one rank leaving while its peers wait.
"""

from __future__ import annotations

import gc
import os
import statistics
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import HetrainError, UsageError
from ..hardware.cluster import parse_cluster
from ..hardware.units import format_bytes
from ..planning.collectives import FREE_LINK, link_from_measurement
from ..planning.plan import DevicePlan, Plan
from ..planning.planner import PlanOptions, make_plan
from . import agree
from .profiler import MAX_SIZE, pool_emulated, profile_device, time_agreement, time_allreduce, time_gradient_sync


def measure(engine, model, optimizer, forward) -> dict:
    """This rank's profile (runtime/profiler.py, cached). Local: no collective."""
    cfg, emu = engine.config, engine.emulated
    mine: dict = {"profile": None, "cached": False, "error": None,
                  "host_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                  "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)}
    cap = None
    if emu is None and engine.device.type == "cuda":
        cap = torch.cuda.get_device_properties(engine.device).total_memory
    if engine.world_size == 1 and emu is None and cap is None:
        return mine          # one device, memory not limited: nothing to decide or measure
    n = len(engine._dataset)
    try:
        mine["profile"], mine["cached"] = profile_device(
            model, optimizer, lambda m: engine._load(range(min(m, n))), device=engine.device,
            label=engine.device_label, forward=forward, precision=engine._precision.compute, memory_bytes=cap,
            max_size=max(1, min(MAX_SIZE, cfg.global_batch, n)), emulate=emu.spec if emu else None)
    except Exception as e:     # noqa: BLE001 — reported on every rank after the gather
        mine["error"] = (type(e).__name__, getattr(e, "what", str(e)), getattr(e, "fix", None),
                         isinstance(e, UsageError))
    return mine


SYNC_RUNS = 5


def _measure_sync(engine, model, grad_bytes, profiles, forward) -> dict[str, float]:
    """Collectives, once every rank is known to be profiled: one gradient-sized all-reduce (the
    link) and SYNC_RUNS synchronised backwards through DDP (the sync this job leaves exposed, and
    each rank's compute before it; every rank on the same micro-batch size). The DDP used for it
    is temporary: the real wrapper (runtime/sharding.py) is chosen after the plan."""
    cfg, n = engine.config, len(engine._dataset)
    probe_bytes = min(grad_bytes, 64 * 1024**2)     # a larger gradient is costed at this bandwidth
    allreduce_s = time_allreduce(probe_bytes, engine.device) * grad_bytes / max(probe_bytes, 1)
    caps = [p.max_micro_batch(margin=cfg.memory_margin) for p in profiles]
    m = min([cfg.global_batch // engine.world_size, n, MAX_SIZE] + [max(1, c // 2) for c in caps if c])
    ddp = DDP(model, device_ids=[engine.device.index] if engine.device.type == "cuda" else None)
    try:
        syncs, computes = time_gradient_sync(ddp, lambda: engine._load(range(max(1, m))), forward=forward,
                                             device=engine.device, precision=engine._precision.compute,
                                             runs=SYNC_RUNS)
    finally:
        del ddp
        gc.collect()
    return _sync_row(allreduce_s, syncs, computes or [0.0] * SYNC_RUNS)


def _sync_row(allreduce_s: float, syncs, computes, *, failed: bool = False) -> dict[str, float]:
    """This rank's row of the sync probe's table (the same keys whether it worked or failed)."""
    return {"allreduce_s": allreduce_s, "failed": float(failed),
            **{f"sync_{k}": v for k, v in enumerate(syncs)},
            **{f"compute_{k}": v for k, v in enumerate(computes)}}


def _straggle(table: agree.Table) -> float:
    """How far the last rank to finish a backward trails the ranks' average, as a fraction,
    when all start together on the same micro-batch size (median over the runs; 0 when the
    probe could not time compute, as on a GPU)."""
    fractions = []
    for k in range(SYNC_RUNS):
        times = table.column(f"compute_{k}")
        if min(times) > 0:             # a run some rank could not time says nothing
            fractions.append(max(times) / (sum(times) / len(times)) - 1)
    return min(1.0, statistics.median(fractions)) if fractions else 0.0


def agree_plan(engine, model, mine: dict, forward) -> Plan:
    """Every rank gathers every rank's profile and runs the same planner on them."""
    cfg = engine.config
    gathered = [mine]
    if engine.world_size > 1:
        gathered = [None] * engine.world_size
        dist.all_gather_object(gathered, mine)
    for rank, g in enumerate(gathered):
        if g["error"] is not None:
            kind, what, fix, usage = g["error"]
            raise (UsageError if usage else HetrainError)(
                f"rank {rank} ({'emulated ' if engine.emulated else ''}device) could not be profiled: "
                f"{kind}: {what}", fix or "see the error above; pass hetrain.init(plan=...) to skip profiling")
    if gathered[0]["profile"] is None:      # a single device with unlimited memory
        micro = min(cfg.global_batch, cfg.micro_batch or cfg.global_batch)
        return Plan(global_batch=cfg.global_batch, note="single device: the whole batch", devices=(
            DevicePlan(rank=0, device=engine.device_label, speed=1.0, share=cfg.global_batch,
                       micro_batch=micro, precision=engine._precision.name,
                       reasons=(f"share {cfg.global_batch}/{cfg.global_batch}: single device",
                                f"micro-batch {micro}: " + ("micro_batch set in the config"
                                                           if micro < cfg.global_batch else "memory not capped"))),))
    n = engine.world_size
    profiles = [g["profile"] for g in gathered]
    grad_bytes = gathered[0]["grad_bytes"]
    link, sync_s, agree_s, straggle, straggle_stretch = FREE_LINK, None, 0.0, 0.0, 1.0
    if n > 1:
        try:
            mine_sync = _measure_sync(engine, model, grad_bytes, profiles, forward)
        except Exception as e:     # noqa: BLE001 — every rank learns of it in the exchange below
            engine.log.warn(f"rank {engine.rank}: measuring the gradient sync failed: {type(e).__name__}: {e}")
            mine_sync = _sync_row(0.0, [0.0] * SYNC_RUNS, [0.0] * SYNC_RUNS, failed=True)
        table = agree.exchange(mine_sync, rank=engine.rank, world_size=n, device=engine.device)
        if table.any("failed"):
            failed = [r for r, v in enumerate(table.column("failed")) if v]
            raise HetrainError(f"measuring the gradient sync failed on rank(s) {failed} (see the warning above)",
                               "pass hetrain.init(plan=...) to run a saved plan without measuring")
        slowest = max(table.column("allreduce_s"))
        # The last rank to reach the sync waits only for the sync itself; earlier ones also wait
        # for it (on a shared host, whoever the scheduler left behind): in each run the least is
        # the sync; the median run is kept.
        sync_s = statistics.median(min(table.column(f"sync_{k}")) for k in range(SYNC_RUNS))
        # Every rank is known to be here (none failed): the step's agreement all-reduce, timed.
        agree_s = min(agree.exchange({"agree_s": time_agreement(engine.device)}, rank=engine.rank,
                                     world_size=n, device=engine.device).column("agree_s"))
        straggle = _straggle(table)
        if engine.emulated is not None:     # the probe ran every device at full speed at once
            straggle_stretch = max(1.0, n / gathered[0]["host_cores"])
        if grad_bytes:
            link = link_from_measurement(n, grad_bytes, slowest, f"measured: a {format_bytes(grad_bytes)} "
                                                                 f"all-reduce took {slowest * 1e3:.1f} ms")
    options = PlanOptions(
        global_batch=cfg.global_batch, grad_bytes=grad_bytes, link=link, memory_margin=cfg.memory_margin,
        sync_s=sync_s, agree_s=agree_s, straggle=straggle, straggle_stretch=straggle_stretch,
        micro_batch_cap=cfg.micro_batch,
        allow_exclusion=False,        # every rank's process is running: each takes >= 1 sample
        allow_checkpointing=cfg.checkpointing != "none",
        # Emulated devices are threads of this host: they contend for its cores (cost.py). Other
        # work on the host is not modelled: it comes and goes faster than a plan lives.
        host_cores=gathered[0]["host_cores"] if engine.emulated is not None else None)
    if engine.emulated is not None and n > 1:    # one CPU, measured by every rank: pool them
        specs = list(parse_cluster(cfg.emulate))
        profiles = pool_emulated(profiles, specs)
    if engine.emulated is not None and cfg.emulate_sample_s is not None:
        profiles = [on_controlled_clock(p, spec, cfg.emulate_sample_s)
                    for p, spec in zip(profiles, parse_cluster(cfg.emulate))]
    engine.profiles = tuple(profiles)            # every rank's, for rebalancing and reports
    plan = make_plan(list(profiles), options)
    cached = sum(bool(g["cached"]) for g in gathered)
    engine.log.info(f"profiles: {cached} of {n} from the cache, {n - cached} measured")
    # The rebalancer's time model of each rank: fixed seconds per micro-batch + seconds per sample.
    return replace(plan, devices=tuple(
        replace(d, per_sample_s=p.per_sample_s, fixed_s=p.overhead_s)
        for d, p in zip(plan.devices, profiles)))


def on_controlled_clock(p, spec, sample_s: float):
    """A profile on the controlled clock (emulate_sample_s): a micro-batch of m samples lasts
    m·sample_s/speed, no fixed part; the host CPU it occupies stays what was measured."""
    device_s = sample_s / spec.speed
    return replace(p, overhead_s=0.0, per_sample_s=device_s,
                   cpu_share=min(1.0, p.per_sample_s * p.cpu_share / device_s),
                   source=p.source + f"; on the controlled clock: {sample_s * 1e3:g} ms/sample at speed 1")


def check_given_plan(engine, plan: Plan) -> Plan:
    if plan.world_size != engine.world_size or plan.global_batch != engine.config.global_batch:
        raise UsageError(
            f"the given plan is for {plan.world_size} device(s) and global batch {plan.global_batch}, "
            f"this job has {engine.world_size} and {engine.config.global_batch}",
            "make a plan for this job (`hetrain plan`), or drop the plan to let hetrain split",
        )
    return plan


def show_plan(log, plan: Plan, total_steps: int) -> None:
    rows = []
    for d in plan.devices:
        sizes = d.micro_sizes()
        micro = f"{sizes[0]}" + (f" x{len(sizes)}" if len(sizes) > 1 else "")
        rows.append((d.rank, d.device, f"{d.speed:.3g}", d.share, micro, d.precision))
    log.table(f"plan v{plan.version}: global batch {plan.global_batch} over {plan.world_size} device(s), "
              f"{total_steps} steps", ("rank", "device", "speed", "share", "micro-batch", "precision"), rows)
    for d in plan.devices:
        for reason in d.reasons:
            log.info(f"  rank {d.rank}: {reason}")
    for line in filter(None, plan.note.split("; ")):
        log.info(f"  plan v{plan.version}: {line}")
