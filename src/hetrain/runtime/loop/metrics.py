"""The run's record, kept by rank 0: metrics.jsonl, TensorBoard scalars, and the status lines.

metrics.jsonl (in Reporting.metrics_dir; by default Checkpoints.dir/metrics when checkpointing, else
none) gets one JSON line per optimizer step and one per event, appended and flushed line by line
(a crash loses nothing; a restart appends after what the attempt before it wrote):

  {"event": "restart", "attempt": N, "step": S}   a restarted attempt (torchrun's count), resumed at step S
  {"event": "start", ...}                         each attempt's header: FLOPs per sample, every device's
                                                  name, precision and peak FLOP/s, what MFU means here
  {"step": i, "time", "loss", "samples_per_s", "step_s", "plan_version", "devices": [per rank, below]}
                                                  step_s: from the previous step's agreement to this one's
  {"event": "oom" | "rebalance" | "skipped_step", "step": i, ...}

Per device (a list indexed by rank): device, share, micro_batch (largest size) and micro_batches
(count), compute_s (forward + backward as the device experiences it: the rebalancer's busy time),
sync_s (the wall time its last backward was blocked in the gradient sync, peers' lateness
included; on a CPU, time the thread was ready but not scheduled is not counted), wait_s (the
rest of the step: step_s − compute_s − sync_s, waiting for peers at the step's agreement, the
optimizer step, loading data, a checkpoint saved before the step, a busy host), peak_bytes (the most it held this step; null
on a plain CPU), memory_cap_bytes (its cap, when capped) and mfu (loop/flops.py).

Every figure comes from the step's agreement table (runtime/ranks/agree.py), which every rank
sends anyway: rank 0 writes the line without a collective of its own. Steps redone after a
restart appear again; the later line is the one that counts (hetrain report reads it so).
"""

from __future__ import annotations

import json
import math
import os

from ..devices import clock as clocks
from ...hardware.units import format_bytes
from ..job import Job
from .flops import format_mfu

FILE = "metrics.jsonl"


def open_recorder(job: Job):
    """Rank 0's Recorder, or None (another rank, or neither a metrics dir nor status lines)."""
    cfg = job.config
    status_every = cfg.reporting.status_every if cfg.reporting.verbose else 0
    directory = cfg.metrics_path()
    if job.rank != 0 or (directory is None and not status_every):
        return None
    out = tb = None
    if directory is not None:
        try:
            os.makedirs(directory, exist_ok=True)
            out = open(os.path.join(directory, FILE), "a", encoding="utf-8")
        except OSError as e:     # rank 0 alone: a warning, not an error its peers would wait on
            job.log.warn_job(f"metrics off: cannot write {os.path.join(directory, FILE)} ({e.strerror or e}); "
                             "give Reporting(metrics_dir=...) (or --metrics-dir) a directory you can write")
            directory = None
        else:
            tb = _tensorboard(directory)
    recorder = Recorder(job, out=out, tensorboard=tb, status_every=status_every)
    if out is not None:
        recorder.start()
        job.log.info(f"metrics: {os.path.join(directory, FILE)}" + (" and TensorBoard scalars" if tb else "")
                     + f" (`hetrain report {directory}` draws them)")
    return recorder


def _tensorboard(directory: str):
    """torch's SummaryWriter when the optional tensorboard package is installed; else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter    # ImportError without tensorboard
    except ImportError:
        return None
    return SummaryWriter(log_dir=directory, flush_secs=10)


class Recorder:
    def __init__(self, job: Job, *, out, tensorboard, status_every: int):
        self.job = job
        self.out = out
        self.tb = tensorboard
        self.status_every = status_every

    # -- lines ----------------------------------------------------------------------------------
    def write(self, line: dict) -> None:
        if self.out is not None:
            self.out.write(json.dumps(line, separators=(",", ":")) + "\n")
            self.out.flush()

    def start(self) -> None:
        job = self.job
        plan, facts, now = job.plan, job.flops, clocks.wall()
        if job.ctx.restart:
            self.write({"event": "restart", "attempt": job.ctx.restart, "step": job.steps_done, "time": now})
        choices = {e["rank"]: e for e in job.precision.all_choices}
        self.write({
            "event": "start", "time": now, "attempt": job.ctx.restart, "step": job.steps_done,
            "world_size": job.world_size, "global_batch": job.config.global_batch, "total_steps": job.total_steps,
            "layout": plan.layout, **job.hooks.run_facts(), "plan_version": plan.version,
            "flops_per_sample": facts.flops_per_sample if facts else None, "flops_how": facts.how if facts else "",
            "mfu_meaning": facts.meaning if facts else "",
            "devices": [{"rank": d.rank, "name": d.device, "precision": d.precision,
                         "computes": choices.get(d.rank, {}).get("compute", d.precision),
                         "peak_flops": facts.peaks[d.rank] if facts else None,
                         "memory_cap_bytes": d.memory_cap_bytes} for d in plan.devices]})

    def record(self, what: str, **facts) -> None:
        """One thing the loop saw (runtime/loop/stepping.py): a step, an OOM, a rebalance."""
        getattr(self, "on_" + what)(**facts)

    def on_step(self, *, step, table, period: float, stepped: bool) -> None:
        line = step_line(self.job, step, table, period)
        self.write(line)
        if not stepped:
            self.write({"event": "skipped_step", "step": step.index, "reason": "inf/NaN gradients (fp16 overflow)",
                        "loss_scale": self.job.precision.loss_scale})
        if self.tb is not None:
            self._scalars(line)
        if self.status_every and (step.index + 1) % self.status_every == 0:
            for text in status_lines(line, total=self.job.total_steps):
                self.job.log.info(text)

    def on_oom(self, *, step: int, before, redone: bool) -> None:
        for old, new in zip(before.devices, self.job.plan.devices):
            if new.micro_batch != old.micro_batch:
                self.write({"event": "oom", "step": step, "rank": old.rank, "device": old.device,
                            "micro_batch_before": old.micro_batch, "micro_batch_after": new.micro_batch,
                            "plan_version": self.job.plan.version,
                            "redo": "every rank (in the gradient sync)" if redone else "this rank, locally"})

    def on_oom_fatal(self, *, step: int, table) -> None:
        for r, fatal in enumerate(table.column("fatal")):
            if fatal:
                self.write({"event": "oom", "step": step, "rank": r, "device": self.job.plan.devices[r].device,
                            "micro_batch_before": 1, "micro_batch_after": None, "fatal": True})

    def on_rebalance(self, *, step: int, before, after, message: str) -> None:
        self.write({"event": "rebalance", "step": step, "version_before": before.version,
                    "version_after": after.version, "shares_before": list(before.shares),
                    "shares_after": list(after.shares), "message": message})

    def _scalars(self, line: dict) -> None:
        tb, i = self.tb, line["step"]
        for key in ("loss", "samples_per_s"):
            if line[key] is not None:
                tb.add_scalar(key, line[key], i)
        for d in line["devices"]:
            tag = f"rank{d['rank']}_" + d["device"].split(" (")[0].replace("#", "_").replace(" ", "_")
            for key in ("compute_s", "wait_s", "sync_s", "mfu"):
                if d[key] is not None:
                    tb.add_scalar(f"{key}/{tag}", d[key], i)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.out is not None:
            self.out.close()
            self.out = None


def step_line(job: Job, step, table, period: float) -> dict:
    """One step's line, from its agreement table (every rank's figures) and the plan it ran.
    `period`: from the previous step's agreement to this one's, which holds every rank's compute."""
    devices = []
    for d in job.plan.devices:
        row = table.row(d.rank)
        compute, sync = row["busy_s"], row["sync_s"]
        devices.append({
            "rank": d.rank, "device": d.device, "share": d.share, "micro_batch": d.micro_batch,
            "micro_batches": d.n_micro, "compute_s": compute, "sync_s": sync,
            "wait_s": max(0.0, period - compute - sync),
            "peak_bytes": int(row["peak_bytes"]) or None, "memory_cap_bytes": d.memory_cap_bytes,
            "mfu": job.flops.mfu(d.rank, samples=d.share, compute_s=compute) if job.flops else None})
    return {"step": step.index, "time": clocks.wall(), "loss": _finite(step.loss),
            "samples_per_s": job.config.global_batch / period if period > 0 else None, "step_s": period,
            "plan_version": job.plan.version, "devices": devices}


def status_lines(line: dict, *, total: int) -> list[str]:
    """Reporting.status_every: the step, then one line per device."""
    loss = f"{line['loss']:.4f}" if line["loss"] is not None else "-"
    sps = f"{line['samples_per_s']:.1f}" if line["samples_per_s"] is not None else "-"
    out = [f"status at step {line['step'] + 1}/{total}: loss {loss}, {sps} samples/s, plan v{line['plan_version']}"]
    for d in line["devices"]:
        memory = format_bytes(d["peak_bytes"]) if d["peak_bytes"] else "-"
        if d["peak_bytes"] and d["memory_cap_bytes"]:
            memory += f" of {format_bytes(d['memory_cap_bytes'])}"
        mfu = f", MFU {format_mfu(d['mfu'])}" if d["mfu"] is not None else ""
        out.append(f"  {d['device']}: share {d['share']} ({d['micro_batches']} micro-batches, max {d['micro_batch']}), "
                   f"compute "
                   f"{d['compute_s'] * 1e3:.0f} ms, wait {d['wait_s'] * 1e3:.0f} ms, sync {d['sync_s'] * 1e3:.0f} ms, "
                   f"memory {memory}{mfu}")
    return out


def _finite(x):
    return float(x) if x is not None and math.isfinite(x) else None
