"""The run's figures at the end: every rank's busy time, memory and OOMs side by side (rank 0
prints), the same dict on every rank."""

from __future__ import annotations

from ...hardware.units import format_bytes
from ..ranks import agree
from ..memory import device_memory as memory
from ..job import Job
from . import flops


class RunStats:
    """What the summary needs, kept as running sums (not a per-step history)."""

    def __init__(self, world_size: int):
        self.steps = 0
        self.timed_steps = 0            # steps after the first (which includes warm-up)
        self.seconds = 0.0
        self.busy = [0.0] * world_size
        self.compute = [0.0] * world_size
        self.samples = [0.0] * world_size   # each rank's share, summed over the same steps (for MFU)
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._first: tuple[float, list[float], list[float], list[float]] | None = None

    def add(self, step, table: agree.Table, seconds: float, shares=()) -> None:
        """One finished step (stepping.StepLoop.on_step), with the shares it ran."""
        busy, compute = table.column("busy_s"), table.column("compute_s")
        shares = list(shares) or [0.0] * len(busy)
        self.steps += 1
        if self.first_loss is None:
            self.first_loss = step.loss
        self.last_loss = step.loss
        if self.steps == 1:             # kept aside: used only when it is the only step
            self._first = (seconds, list(busy), list(compute), shares)
            return
        self.timed_steps += 1
        self.seconds += seconds
        self.busy = [a + b for a, b in zip(self.busy, busy)]
        self.compute = [a + b for a, b in zip(self.compute, compute)]
        self.samples = [a + b for a, b in zip(self.samples, shares)]

    def timed(self) -> tuple[int, float, list[float], list[float]]:
        """(steps, seconds, busy, compute) over the steps after the first, or the first alone."""
        return self._timed()[:4]

    def timed_samples(self) -> list[float]:
        """Each rank's samples over the same steps as timed()."""
        return self._timed()[4]

    def _timed(self):
        if self.timed_steps == 0 and self._first is not None:
            return (1, *self._first)
        return self.timed_steps, self.seconds, self.busy, self.compute, self.samples


def summarize(job: Job, stats: RunStats) -> dict:
    """A collective: the run's figures, the same on every rank; rank 0 prints them."""
    timed, seconds, busy, compute = stats.timed()
    plan, log = job.plan, job.log
    mine = {"busy_s": busy[job.rank], "compute_s": compute[job.rank], "ooms": job.ooms,
            "peak_bytes": job.hooks.peak_bytes()}
    table = agree.exchange(mine, rank=job.rank, world_size=job.world_size, device=job.device)
    out = {
        "steps": stats.steps,
        "samples_per_s": (timed * job.config.global_batch / seconds) if seconds else None,
        "first_loss": stats.first_loss,
        "last_loss": stats.last_loss,
        "plan_version": plan.version if plan else None,
        "shares": list(plan.shares) if plan else [],
        "micro_batches": [d.micro_batch for d in plan.devices] if plan else [],
        "max_micro_batches": [d.max_micro_batch for d in plan.devices] if plan else [],
        "predicted": dict(plan.predicted) if plan else {},
        "predicted_compute_s": [d.predicted_compute_s for d in plan.devices] if plan else [],
        "profiles": [p.to_dict() for p in job.profiles] if job.profiles else [],
        "redone_steps": job.redone_steps,
        "rebalances": job.rebalances,
        "ranks": [table.row(r) for r in range(job.world_size)],
        # per rank: busy / step time, and MFU (runtime/loop/flops.py; None where it is not known)
        "efficiency": [b / seconds if seconds else None for b in busy],
        "mfu": [job.flops.mfu(r, samples=n, compute_s=b) if job.flops else None
                for r, (n, b) in enumerate(zip(stats.timed_samples(), busy))],
        "flops_per_sample": job.flops.flops_per_sample if job.flops else None,
    }
    if stats.steps and plan is not None:
        rows = []
        for d in plan.devices:
            r = out["ranks"][d.rank]
            eff, mfu = out["efficiency"][d.rank], out["mfu"][d.rank]
            rows.append((d.rank, d.device, d.share, d.micro_batch,
                         f"{r['busy_s'] / max(timed, 1) * 1000:.0f} ms",
                         f"{eff:.0%}" if eff is not None else "-", flops.format_mfu(mfu),
                         format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-", int(r["ooms"])))
        sps = f"{out['samples_per_s']:.1f}" if out["samples_per_s"] else "-"
        log.table(
            f"summary: {stats.steps} steps, {sps} samples/s, loss {out['first_loss']:.4f} -> "
            f"{out['last_loss']:.4f}, plan v{plan.version}" + job.hooks.summary_note(),
            ("rank", "device", "share", "micro", "busy/step", "efficiency", "MFU", "peak memory", "OOMs"), rows)
        if job.flops and any(m is not None for m in out["mfu"]):
            log.info(f"  efficiency: busy / step time; MFU: {job.flops.meaning}, at "
                     f"{job.flops.flops_per_sample:.3g} FLOPs/sample")
    out["precision"] = job.precision.summary()                 # skipped steps, per-rank precisions
    job.precision.show_summary(log, steps=stats.steps)
    out["host"] = job.host.to_dict() if job.host is not None else None
    out["memory"] = memory.report(plan=plan, memory_plan=job.memory_plan, rank=job.rank, world_size=job.world_size,
                                  device=job.device, meter=job.hooks.meter, log=log, peak=job.hooks.peak_bytes())
    log.flush()
    return out

