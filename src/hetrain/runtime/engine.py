"""The runtime verbs: init() / prepare(), then backward(), step() and autocast() in the user's loop.

One Engine per process. It joins the process group, builds (or receives) the Plan, wraps the model
in DDP, feeds this rank its slice of every global batch in micro-batches, weights each
micro-batch's loss so the synchronised gradient is the big-batch gradient (reduce.py), and lets
DDP all-reduce exactly once per step: every micro-batch but the last runs under no_sync(), forward
included (with backward alone inside no_sync, DDP syncs every micro-batch and unequal counts
deadlock).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

from ..errors import HetrainError, UsageError
from ..hardware.cluster import parse_cluster
from ..hardware.units import format_bytes
from ..planning.cost import FREE_LINK, link_from_measurement
from ..planning.plan import DevicePlan, Plan
from ..planning.planner import PlanOptions, make_plan
from . import agree, reduce
from .config import Config
from .data import GlobalCursorSampler
from .dist import DistContext, init_distributed, shutdown
from .emulate import EmulatedDevice
from .failure import install_excepthook
from .log import RankLog
from .model import PreparedModel
from .probe import default_forward
from .profiler import MAX_SIZE, pool_emulated, profile_device, time_allreduce, time_gradient_sync
from .steps import MicroBatch, Step, Steps

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


class Engine:
    """What `hetrain.init()` returns. All ranks call the same methods in the same order."""

    def __init__(self, config: Config, *, plan: Plan | None = None):
        self.config = config = config.with_launch_file()
        cluster = parse_cluster(config.emulate) if config.emulate else None
        if cluster is not None:
            torch.set_num_threads(1)   # one emulated device = one CPU thread, throttled from there
        use_cuda = cluster is None and torch.cuda.is_available()
        self.ctx: DistContext = init_distributed(timeout_s=config.timeout_s, use_cuda=use_cuda)
        self.log = RankLog(rank=self.ctx.rank, verbose=config.verbose)
        install_excepthook(self.ctx.rank, self.ctx.world_size)
        if cluster is not None and len(cluster) != self.ctx.world_size:
            raise UsageError(
                f"the cluster spec {config.emulate!r} names {len(cluster)} devices, "
                f"but {self.ctx.world_size} process(es) are running",
                f"launch with `hetrain run --emulate {config.emulate} script.py` "
                "(one process per emulated device)",
            )
        self.emulated = EmulatedDevice(cluster[self.ctx.rank]) if cluster is not None else None
        self.plan: Plan | None = None
        self.profiles: tuple | None = None       # every rank's DeviceProfile, when this job measured them
        self._given_plan = plan if plan is not None else _plan_from_file(config.plan)
        self.steps_done = 0
        self.total_steps = 0
        self._closed = False
        self._model: PreparedModel | None = None
        self._ddp: DDP | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler = (torch.amp.GradScaler(self.device.type) if config.precision == "fp16" else None)
        self._mb: MicroBatch | None = None
        self._step: Step | None = None
        self._table: agree.Table | None = None
        self._step_started = 0.0
        self._history: list[dict] = []
        torch.manual_seed(config.seed)

    # -- facts --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    def _clock(self) -> float:
        """This rank's compute clock: thread CPU time on CPU (waits in collectives excluded)."""
        return time.thread_time() if self.device.type == "cpu" else time.perf_counter()

    @property
    def device_label(self) -> str:
        if self.emulated is not None:
            return self.emulated.label
        if self.device.type == "cuda":
            return f"cuda:{self.device.index} {torch.cuda.get_device_name(self.device)}"
        return f"cpu (rank {self.rank})"

    def print(self, message: str) -> None:
        """Print once, from rank 0."""
        self.log.info(message)

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                collate_fn: Callable | None = None, forward: Callable = default_forward):
        """Wrap the model for data parallelism, plan the split, and return the steps to iterate.

        `forward(model, batch)` is how hetrain calls the model when it measures it before training
        (default: model(x) for (x, y) batches); the user's loop calls the model itself.
        """
        if self._model is not None:
            raise UsageError("prepare() was already called", "call prepare() once per hetrain.init()")
        cfg = self.config
        model.to(self.device)
        self._dataset = dataset
        self._collate = collate_fn or default_collate
        self._sampler = GlobalCursorSampler(len(dataset), cfg.global_batch, seed=cfg.seed,
                                            shuffle=cfg.shuffle, drop_last=cfg.drop_last)
        self.total_steps = self._count_steps()
        meter = self.emulated.meter if self.emulated is not None else None
        if meter is not None:
            meter.set_fixed(model, optimizer)
        # DDP first (it does not depend on the plan): planning times a real gradient sync through it.
        self._ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self._given_plan is not None:
            self.plan = self._check_given_plan(self._given_plan)
        else:
            self.plan = self._agree_plan(self._measure(model, optimizer, forward))
        self._model = PreparedModel(model, self._ddp, meter)
        self._optimizer = optimizer
        self._show_plan()
        return self._model, optimizer, Steps(self)

    def _count_steps(self) -> int:
        cfg = self.config
        if cfg.max_steps is not None:
            return cfg.max_steps
        return math.ceil((cfg.epochs or 1.0) * self._sampler.steps_per_epoch - 1e-9)

    def _load(self, indices) -> object:
        ds = self._dataset
        items = ds.__getitems__(list(indices)) if hasattr(ds, "__getitems__") else [ds[i] for i in indices]
        return _to_device(self._collate(items), self.device)

    def _measure(self, model, optimizer, forward) -> dict:
        """This rank's profile (runtime/profiler.py, cached). Local: no collective. A failure is
        returned, not raised, so that every rank learns of it in the gather that follows instead
        of waiting for a peer that has left."""
        cfg, emu = self.config, self.emulated
        mine: dict = {"profile": None, "cached": False, "error": None, "forward": forward,
                      "host_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                      "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)}
        cap = None
        if emu is None and self.device.type == "cuda":
            cap = torch.cuda.get_device_properties(self.device).total_memory
        if self.world_size == 1 and emu is None and cap is None:
            return mine          # one device, memory not limited: nothing to decide or measure
        n = len(self._dataset)
        try:
            mine["profile"], mine["cached"] = profile_device(
                model, optimizer, lambda m: self._load(range(min(m, n))), device=self.device,
                label=self.device_label, forward=forward, precision=cfg.precision, memory_bytes=cap,
                max_size=max(1, min(MAX_SIZE, cfg.global_batch, n)), emulate=emu.spec if emu else None)
        except Exception as e:     # noqa: BLE001 — reported on every rank after the gather
            mine["error"] = (type(e).__name__, getattr(e, "what", str(e)), getattr(e, "fix", None),
                             isinstance(e, UsageError))
        return mine

    def _measure_sync(self, profiles, forward) -> dict[str, float]:
        """Collectives, once every rank is known to be profiled: one gradient-sized all-reduce (the
        link) and a real synchronised backward through DDP against one under no_sync (the sync
        this job leaves exposed), every rank on the same micro-batch size: about an equal share,
        at most half of what the smallest device holds."""
        cfg, n = self.config, len(self._dataset)
        grad_bytes = sum(p.numel() * p.element_size() for p in self._ddp.module.parameters() if p.requires_grad)
        probe_bytes = min(grad_bytes, 64 * 1024**2)     # a larger gradient is costed at this bandwidth
        allreduce_s = time_allreduce(probe_bytes, self.device) * grad_bytes / max(probe_bytes, 1)
        caps = [p.max_micro_batch(margin=cfg.memory_margin) for p in profiles]
        m = min([cfg.global_batch // self.world_size, n, MAX_SIZE] + [max(1, c // 2) for c in caps if c])
        sync_s = time_gradient_sync(self._ddp, lambda: self._load(range(max(1, m))), forward=forward,
                                    device=self.device, precision=cfg.precision)
        return {"allreduce_s": allreduce_s, "sync_s": sync_s}

    def _agree_plan(self, mine: dict) -> Plan:
        """Every rank gathers every rank's measurements and runs the same pure planner on them, so
        all get the same Plan without a further exchange."""
        forward = mine.pop("forward")
        gathered = [mine]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
        for rank, g in enumerate(gathered):
            if g["error"] is not None:
                kind, what, fix, usage = g["error"]
                raise (UsageError if usage else HetrainError)(
                    f"rank {rank} ({'emulated ' if self.emulated else ''}device) could not be profiled: "
                    f"{kind}: {what}", fix or "see the error above; pass hetrain.init(plan=...) to skip profiling")
        cfg = self.config
        if gathered[0]["profile"] is None:      # a single device with unlimited memory
            micro = min(cfg.global_batch, cfg.micro_batch or cfg.global_batch)
            return Plan(global_batch=cfg.global_batch, note="single device: the whole batch", devices=(
                DevicePlan(rank=0, device=self.device_label, speed=1.0, share=cfg.global_batch,
                           micro_batch=micro, precision=cfg.precision,
                           reasons=(f"share {cfg.global_batch}/{cfg.global_batch}: single device",
                                    f"micro-batch {micro}: " + ("micro_batch set in the config"
                                                               if micro < cfg.global_batch else
                                                               "memory not capped"))),))
        n = self.world_size
        grad_bytes = gathered[0]["grad_bytes"]
        link, sync_s = FREE_LINK, None
        if n > 1:
            table = agree.exchange(self._measure_sync([g["profile"] for g in gathered], forward),
                                   rank=self.rank, world_size=n, device=self.device)
            slowest = max(table.column("allreduce_s"))
            # The last rank to reach the sync waits only for the sync itself; earlier ones also wait
            # for it (on a shared host, whoever the scheduler left behind): the least is the sync.
            sync_s = min(table.column("sync_s"))
            if grad_bytes:
                link = link_from_measurement(n, grad_bytes, slowest, f"measured: a {format_bytes(grad_bytes)} "
                                                                     f"all-reduce took {slowest * 1e3:.1f} ms")
        options = PlanOptions(
            global_batch=cfg.global_batch, grad_bytes=grad_bytes, link=link, memory_margin=cfg.memory_margin,
            sync_s=sync_s, micro_batch_cap=cfg.micro_batch,
            allow_exclusion=False,        # every rank's process is running: each takes >= 1 sample
            allow_checkpointing=False,    # hook: turn on when the runtime checkpoints activations
            # Emulated devices are threads of this host: they contend for its cores (cost.py). Other
            # work on the host is not modelled: it comes and goes faster than a plan lives.
            host_cores=gathered[0]["host_cores"] if self.emulated is not None else None)
        profiles = [g["profile"] for g in gathered]
        if self.emulated is not None and n > 1:    # one CPU, measured by every rank: pool them
            profiles = pool_emulated(profiles, list(parse_cluster(cfg.emulate)))
        self.profiles = tuple(profiles)           # every rank's, for rebalancing and reports
        plan = make_plan(list(self.profiles), options)
        cached = sum(bool(g["cached"]) for g in gathered)
        self.log.info(f"profiles: {cached} of {n} from the cache, {n - cached} measured")
        return plan

    def _check_given_plan(self, plan: Plan) -> Plan:
        if plan.world_size != self.world_size or plan.global_batch != self.config.global_batch:
            raise UsageError(
                f"the given plan is for {plan.world_size} device(s) and global batch {plan.global_batch}, "
                f"this job has {self.world_size} and {self.config.global_batch}",
                "make a plan for this job (`hetrain plan`), or drop the plan to let hetrain split",
            )
        return plan

    def _show_plan(self) -> None:
        plan = self.plan
        rows = []
        for d in plan.devices:
            sizes = d.micro_sizes()
            micro = f"{sizes[0]}" + (f" x{len(sizes)}" if len(sizes) > 1 else "")
            rows.append((d.rank, d.device, f"{d.speed:.3g}", d.share, micro, d.precision))
        self.log.table(f"plan v{plan.version}: global batch {plan.global_batch} over "
                       f"{plan.world_size} device(s), {self.total_steps} steps",
                       ("rank", "device", "speed", "share", "micro-batch", "precision"), rows)
        for d in plan.devices:
            for reason in d.reasons:
                self.log.info(f"  rank {d.rank}: {reason}")
        for line in filter(None, plan.note.split("; ")):
            self.log.info(f"  {line}")

    # -- the loop -----------------------------------------------------------------------------
    def _begin_step(self) -> Step:
        if self._step is not None and self._table is None:
            raise UsageError(f"step {self._step.index} ended before all its micro-batches ran",
                             "iterate every micro-batch of a step (for mb in step: ...) before ht.step()")
        if self._step is not None:
            raise UsageError(f"step {self._step.index} has no ht.step() call",
                             "call ht.step() once after each step's micro-batches")
        samples = self._sampler.next_step()
        plan = self.plan
        mine = samples.for_rank(plan.offsets(), plan.shares, self.rank)
        if self._step_started == 0.0:
            self._step_started = time.perf_counter()
        self._step = Step(index=samples.step, epoch=samples.epoch, indices=mine, _engine=self)
        self._count = 0.0
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._compute_s = 0.0
        return self._step

    def _micro_batches(self, step: Step):
        if step is not self._step or step.started:
            raise UsageError("a step's micro-batches can be iterated once, before ht.step()",
                             "iterate `for mb in step` once per step")
        step.started = True
        sizes = self.plan.devices[self.rank].micro_sizes()
        clock = self._clock
        start = 0
        for k, size in enumerate(sizes):
            chunk = step.indices[start:start + size]
            start += size
            mb = MicroBatch(batch=self._load(chunk), size=size, index=k, count=len(sizes), indices=chunk)
            self._mb = mb
            sync = contextlib.nullcontext() if mb.last else self._ddp.no_sync()
            mb.started_at = clock()
            with sync:
                yield mb
            spent = clock() - mb.started_at
            self._compute_s += spent
            if self.emulated is not None:   # what ran after backward(); forward+backward are booked
                self.emulated.throttle.charge(spent - mb.booked_cpu)
            if not mb.backward_done:
                raise UsageError(f"micro-batch {k} of step {step.index} ended without ht.backward(loss)",
                                 "call ht.backward(loss) once inside every micro-batch")
        self._mb = None
        self._table = agree.exchange(
            {"units": self._count, "loss_sum": float(self._loss_sum), "compute_s": self._compute_s},
            rank=self.rank, world_size=self.world_size, device=self.device)

    def autocast(self):
        """Autocast to this job's precision on this rank's device (a no-op for fp32)."""
        dtype = _DTYPES.get(self.config.precision)
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def backward(self, loss: torch.Tensor, *, tokens: int | float | torch.Tensor | None = None) -> None:
        """Backpropagate one micro-batch's mean loss, weighted so the step's gradient is the
        big-batch gradient. With loss_weighting='tokens', pass the number of tokens the loss
        averaged over."""
        mb = self._mb
        if mb is None or mb.backward_done:
            raise UsageError("ht.backward() called outside a micro-batch, or twice for one",
                             "call ht.backward(loss) once inside each `for mb in step` iteration")
        if self.config.loss_weighting == "tokens":
            if tokens is None:
                raise UsageError("loss_weighting='tokens' needs the token count of each micro-batch",
                                 "call ht.backward(loss, tokens=n) with the tokens the loss averaged over")
            units = float(tokens)
        else:
            units = float(mb.size)
        factor = reduce.loss_factor(units=units, world_size=self.world_size,
                                    global_batch=self.config.global_batch)
        scaled = loss * factor
        if self._scaler is not None:
            scaled = self._scaler.scale(scaled)
        if self.emulated is None:
            scaled.backward()
        else:   # sleep before the backward, so this device's gradients reach the sync late (emulate.py)
            throttle = self.emulated.throttle
            forward_cpu = self._clock() - mb.started_at
            guess = throttle.before_backward(forward_cpu)
            t0 = self._clock()
            scaled.backward()
            backward_cpu = self._clock() - t0
            throttle.after_backward(forward_cpu, guess, backward_cpu)
            mb.booked_cpu = forward_cpu + backward_cpu
        mb.backward_done = True
        self._count += units
        self._loss_sum += loss.detach().double() * units

    def step(self) -> Step:
        """Finish the step: correct token weighting, clip, optimizer step, zero gradients."""
        step, table = self._step, self._table
        if step is None or table is None:
            raise UsageError("ht.step() called before the step's micro-batches all ran",
                             "run `for mb in step: ...` to the end, then call ht.step()")
        opt, cfg = self._optimizer, self.config
        params = [p for p in self._model.parameters() if p.grad is not None]
        if self._scaler is not None:
            self._scaler.unscale_(opt)
        total_units = table.sum("units")
        if cfg.loss_weighting == "tokens":
            reduce.scale_gradients(params, reduce.token_correction(global_batch=cfg.global_batch,
                                                                   total_units=total_units))
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        throttle = self.emulated.throttle.compute() if self.emulated else contextlib.nullcontext()
        with throttle:
            if self._scaler is not None:
                self._scaler.step(opt)
                self._scaler.update()
            else:
                opt.step()
        opt.zero_grad(set_to_none=True)
        if self.emulated is not None and self.steps_done == 0:
            self.emulated.meter.set_fixed(self._model.module, opt)  # optimizer state now exists

        now = time.perf_counter()
        elapsed, self._step_started = now - self._step_started, now
        step.loss = table.sum("loss_sum") / total_units
        step.samples_per_s = cfg.global_batch / elapsed
        self._history.append({"step": step.index, "loss": step.loss, "seconds": elapsed,
                              "compute_s": table.column("compute_s")})
        self.steps_done += 1
        self._step, self._table = None, None
        return step

    # -- the end ------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Run figures (same on every rank); rank 0 prints them with every rank side by side.
        A collective: every rank calls it."""
        hist = self._history
        timed = hist[1:] if len(hist) > 1 else hist   # the first step includes warm-up
        seconds = sum(h["seconds"] for h in timed)
        mine = {"compute_s": sum(h["compute_s"][self.rank] for h in timed),
                "slept_s": self.emulated.throttle.slept_seconds if self.emulated else 0.0,
                "peak_bytes": float(self.emulated.meter.peak) if self.emulated else
                (float(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else 0.0)}
        table = agree.exchange(mine, rank=self.rank, world_size=self.world_size, device=self.device)
        out = {
            "steps": len(hist),
            "samples_per_s": (len(timed) * self.config.global_batch / seconds) if seconds else None,
            "first_loss": hist[0]["loss"] if hist else None,
            "last_loss": hist[-1]["loss"] if hist else None,
            "ranks": [table.row(r) for r in range(self.world_size)],
            "predicted": dict(self.plan.predicted) if self.plan is not None else {},
            "shares": list(self.plan.shares) if self.plan is not None else [],
            "micro_batches": [d.micro_batch for d in self.plan.devices] if self.plan is not None else [],
            "max_micro_batches": [d.max_micro_batch for d in self.plan.devices] if self.plan is not None else [],
            "predicted_compute_s": [d.predicted_compute_s for d in self.plan.devices] if self.plan is not None else [],
            "profiles": [p.to_dict() for p in self.profiles] if self.profiles else [],
        }
        if hist and self.plan is not None:
            rows = []
            for d in self.plan.devices:
                r = out["ranks"][d.rank]
                busy = r["compute_s"] + r["slept_s"]
                rows.append((d.rank, d.device, d.share,
                             f"{busy / max(len(timed), 1) * 1000:.0f} ms",
                             f"{busy / seconds:.0%}" if seconds else "-",
                             format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-"))
            sps = out["samples_per_s"]
            self.log.table(
                f"summary: {len(hist)} steps, {sps:.1f} samples/s, loss {out['first_loss']:.4f} -> "
                f"{out['last_loss']:.4f}" + (" (emulated devices)" if self.emulated else ""),
                ("rank", "device", "share", "compute/step", "busy", "peak memory"), rows)
        return out

    def close(self) -> None:
        """Leave the process group cleanly (a collective: every rank calls it)."""
        if self._closed:
            return
        self._closed = True
        if self._model is not None:
            self._model.release_wrapper()
        self._ddp = None
        shutdown(self.ctx)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:   # peers may be gone: no barrier, just release what we hold
            self._closed = True
            if self._model is not None:
                self._model.release_wrapper()
            self._ddp = None
            if self.ctx.owns_group and dist.is_initialized():
                dist.destroy_process_group()


def _plan_from_file(path: str | None) -> Plan | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return Plan.from_json(f.read())
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"cannot read the plan {path!r}: {e}",
                         "pass a file written by `hetrain plan --out`, or no plan") from None


def init(*, plan: Plan | str | None = None, **config) -> Engine:
    """Join the job and read its configuration. Keyword arguments: see hetrain.runtime.config.Config;
    `plan` (a Plan, or the path of one saved as JSON) fixes every rank's share and micro-batch."""
    if isinstance(plan, str):
        config["plan"] = plan
        plan = None
    return Engine(Config(**config), plan=plan)
