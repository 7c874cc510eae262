"""The runtime verbs: init() / prepare(), then backward(), step() and autocast() in the user's loop.

One Engine per process. It joins the process group, agrees a Plan with its peers, wraps the model
in DDP, feeds this rank its slice of every global batch in micro-batches, weights each
micro-batch's loss so the synchronised gradient is the big-batch gradient (reduce.py), and lets
DDP all-reduce exactly once per step: every micro-batch but the last runs under no_sync(), forward
included (with backward alone inside no_sync, DDP syncs every micro-batch and unequal counts
deadlock).

Each step ends with one small all-reduce of a table of every rank's figures (agree.py): loss and
counts, timings, out-of-memory events, micro-batch sizes. Everything that changes what ranks do
next — redo a step after an OOM, a new Plan after an OOM or a rebalance, stop together — is
decided from that table, identically on every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import time
from dataclasses import replace
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

from ..errors import HetrainError, UsageError
from ..hardware.cluster import parse_cluster
from ..hardware.units import format_bytes
from ..planning.plan import Plan, split_evenly
from . import agree, checkpointing, memory, persist, precision, recovery, reduce
from .joint_plan import RankFacts, check_given_plan, measure_job, show_plan
from .measurements import plan_from_measurements
from .checkpoint import Checkpointer
from .config import Config
from .data import GlobalCursorSampler, to_device
from .dist import DistContext, init_distributed, shutdown
from .emulate import EmulatedDevice, agree_host_facts
from .failure import install_excepthook
from .faults import ENV as FAULTS_ENV
from .faults import FaultInjector, injected_oom, parse_faults
from .log import RankLog
from .model import PreparedModel
from .probe import default_forward
from .rebalance import Rebalancer
from .steps import MicroBatch, Step, Steps


class Engine:
    """What `hetrain.init()` returns. All ranks call the same methods in the same order."""

    def __init__(self, config: Config, *, plan: Plan | None = None):
        import os

        self.config = config = config.with_launch_file()
        cluster = parse_cluster(config.emulate) if config.emulate else None
        if cluster is not None:
            torch.set_num_threads(1)   # one emulated device = one CPU thread, throttled from there
        use_cuda = cluster is None and torch.cuda.is_available()
        self.ctx: DistContext = init_distributed(timeout_s=config.timeout_s, use_cuda=use_cuda)
        self.log = RankLog(rank=self.ctx.rank, verbose=config.verbose)
        install_excepthook(self)
        if cluster is not None and len(cluster) != self.ctx.world_size:
            raise UsageError(
                f"the cluster spec {config.emulate!r} names {len(cluster)} devices, "
                f"but {self.ctx.world_size} process(es) are running",
                f"launch with `hetrain run --emulate {config.emulate} script.py` "
                "(one process per emulated device)",
            )
        self.emulated = (EmulatedDevice(cluster[self.ctx.rank], sample_s=config.emulate_sample_s)
                         if cluster is not None else None)
        # [emulation] how fast this CPU computes bf16/fp16: decides what an emulated device computes in
        self.host = agree_host_facts(rank=self.rank, world_size=self.world_size) if cluster is not None else None
        if self.host is not None:
            self.log.info(f"host CPU: {self.host.describe()}; {self.host.emulation_meaning()} "
                          f"[{self.host.source}]")
            if self.host.note:
                self.log.warn(self.host.note)
        self.faults = FaultInjector(parse_faults(config.faults or os.environ.get(FAULTS_ENV)),
                                    rank=self.ctx.rank, attempt=self.ctx.restart)
        if self.faults and self.emulated is None:
            raise UsageError("fault injection needs emulated devices", "add --emulate SPEC (or emulate=...)")
        self.plan: Plan | None = None
        self.profiles: tuple | None = None   # every rank's DeviceProfile, when this job measured them
        self._given_plan = plan if plan is not None else _plan_from_file(config.plan)
        self.steps_done = 0
        self.total_steps = 0
        self._closed = False
        self._model: PreparedModel | None = None
        self._ddp: DDP | None = None
        self._guard: recovery.SyncGuard | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        # [precision] this rank's choice; prepare() agrees it across ranks (bad input raises there)
        self._precision = precision.PrecisionPolicy.local(
            config.precision, device=self.device, emulated=self.emulated, host=self.host,
            allow_fallback=config.allow_fallback)
        self._memory_plan: memory.MemoryPlan | None = None
        self._rebalancer: Rebalancer | None = None
        self._checkpointer: Checkpointer | None = None
        self._extra_state: dict[str, object] = {}
        self._mb: MicroBatch | None = None
        self._step: Step | None = None
        self._table: agree.Table | None = None
        self._step_started = 0.0
        self._fixed_s = 0.0            # busy time of the last step outside its micro-batches
        self._checkpoint_due = False
        self._stats = _RunStats(self.ctx.world_size)
        self._state_counted = False    # the emulated meter counts optimizer state once it exists
        self.ooms = 0                  # out-of-memory errors recovered on this rank
        self.redone_steps = 0          # steps redone by all ranks after an OOM in a gradient sync
        self.rebalances = 0            # share changes made by the rebalancer
        torch.manual_seed(config.seed)
        atexit.register(self._at_exit)

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

    def _busy(self) -> float:
        """Compute time as the device experiences it: CPU time plus the emulation's sleeps."""
        return self._clock() + (self.emulated.throttle.slept_seconds if self.emulated else 0.0)

    @property
    def _scaler(self) -> torch.amp.GradScaler | None:
        """The job-wide loss scaler, when any device runs fp16 (runtime/precision.py)."""
        return self._precision.scaler

    @property
    def device_label(self) -> str:
        if self.emulated is not None:
            return self.emulated.label
        if self.device.type == "cuda":
            return f"cuda:{self.device.index} {torch.cuda.get_device_name(self.device)}"
        return f"cpu (rank {self.rank})"

    @property
    def current_micro_batch(self) -> int | None:
        return self.plan.devices[self.rank].micro_batch if self.plan else None

    def print(self, message: str) -> None:
        """Print once, from rank 0."""
        self.log.info(message)

    # -- prepare ------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                collate_fn: Callable | None = None, forward: Callable = default_forward):
        """Wrap the model for data parallelism, plan the split, resume if a checkpoint exists,
        and return the steps to iterate.

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
        if cfg.checkpoint_dir:
            self._checkpointer = Checkpointer(cfg.checkpoint_dir, keep=cfg.keep_checkpoints,
                                              rank=self.rank, log=self.log)
        meter = self.emulated.meter if self.emulated is not None else None
        if meter is not None:
            meter.set_fixed(model, optimizer)
        # [precision, checkpointing] agree precisions; checkpoint before the probe when asked everywhere
        self._precision.agree(rank=self.rank, world_size=self.world_size, device=self.device, log=self.log)
        if cfg.checkpointing == "all":
            checkpointing.checkpoint_blocks(model, cfg.checkpoint_blocks)
        if self._given_plan is not None:
            self.plan = check_given_plan(self, self._given_plan)
        else:
            job = RankFacts(rank=self.rank, world_size=self.world_size, device=self.device, label=self.device_label,
                            emulated=self.emulated.spec if self.emulated is not None else None,
                            compute=self._precision.compute, precision=self._precision.name,
                            load=lambda m: self._load(range(m)), samples=len(dataset), config=cfg, log=self.log)
            self.plan, self.profiles = plan_from_measurements(measure_job(job, model, optimizer, forward), cfg)
        # A checkpoint's Plan (rebalanced shares, shrunk micro-batches) is adopted before the model
        # is set up for it: checkpointing and sharding follow the plan that will run.
        resume_from = persist.find_checkpoint(self, model) if self._checkpointer is not None else None
        if self._checkpointer is not None:
            self.plan = persist.adopt_plan(self, resume_from)
        # [checkpointing, sharding, memory] per-device checkpointing, then the data-parallel wrapper
        self.plan, _ = checkpointing.apply_from_plan(model, self._precision.record_in(self.plan), self.rank,
                                                     mode=cfg.checkpointing, block_type=cfg.checkpoint_blocks)
        wrapped, self._memory_plan = memory.wrap_for_plan(self, model, optimizer, forward)
        self._ddp = wrapped.sync            # DDP, or FSDP2's adapter: .no_sync() on non-last micro-batches
        # recovery.SyncGuard on DDP (FSDP2's adapter guards itself): a comm hook that records the
        # buckets a backward launched. Only when OOM recovery needs it: else DDP's own C++ all-reduce.
        self._guard = wrapped.sync_guard() if cfg.oom_recovery and self.world_size > 1 else None
        self._model = PreparedModel(model, wrapped.forward_module, meter)
        optimizer = wrapped.optimizer
        memory.show_wrapping(self.log, wrapped)
        if self.faults:   # an injected forward OOM strikes inside DDP's forward, as a real one does
            model.register_forward_pre_hook(lambda module, args: self._before_forward())
        self._optimizer = optimizer
        if cfg.rebalance and self.world_size > 1:
            self._rebalancer = Rebalancer(world_size=self.world_size, threshold=cfg.rebalance_threshold,
                                          micro_batch_cap=cfg.micro_batch)
        if resume_from is not None:
            persist.restore(self, resume_from)
        show_plan(self.log, self.plan, self.total_steps)
        # Python's full (generation-2) collection scans every live object: after the imports,
        # profiling and planning that is a large heap, and one pass took ~140 ms in the middle of
        # training here (a step is ~110 ms). Collect once now and freeze what is alive, so the
        # collections during training look only at objects made during training (as torchtitan
        # controls GC in its loop). _release() unfreezes, so the wrapper can be freed at the end.
        gc.collect()
        gc.freeze()
        return self._model, optimizer, Steps(self)

    def register_state(self, name: str, obj) -> None:
        """Checkpoint `obj` (anything with state_dict/load_state_dict, e.g. an LR scheduler)
        with the job, and restore it on resume. Call before prepare()."""
        if self._model is not None:
            raise UsageError(f"register_state({name!r}) after prepare()", "register state before ht.prepare()")
        self._extra_state[name] = obj

    def _count_steps(self) -> int:
        cfg = self.config
        if cfg.max_steps is not None:
            return cfg.max_steps
        return math.ceil((cfg.epochs or 1.0) * self._sampler.steps_per_epoch - 1e-9)

    def _load(self, indices) -> object:
        ds = self._dataset
        items = ds.__getitems__(list(indices)) if hasattr(ds, "__getitems__") else [ds[i] for i in indices]
        return to_device(self._collate(items), self.device)

    # -- the loop -----------------------------------------------------------------------------
    def _begin_step(self) -> Step:
        if self._step is not None:
            raise UsageError(f"step {self._step.index} has no ht.step() call",
                             "call ht.step() once after each step's micro-batches")
        self._at_boundary()
        self.faults.at_step_start(self.steps_done)
        escaped = self.faults.oom(self.steps_done, 0, 1, "forward", escape=1) if self.faults else None
        if escaped is not None:      # as if the user's code ran out of memory outside `with mb:`
            raise injected_oom(escaped)
        if self.emulated is not None and self.faults:
            self.emulated.throttle.slowdown = self.faults.slowdown(self.steps_done)
            self.emulated.throttle.noise = self.faults.noise(self.steps_done)
        samples = self._sampler.next_step()
        plan = self.plan
        start = plan.offsets()[self.rank]
        end = start + plan.shares[self.rank]
        if self._step_started == 0.0:
            self._step_started = time.perf_counter()
        self._step = Step(index=samples.step, epoch=samples.epoch, indices=samples.indices[start:end],
                          epochs=samples.epochs[start:end], _engine=self)
        return self._step

    def _micro_batches(self, step: Step):
        if step is not self._step or step.started:
            raise UsageError("a step's micro-batches can be iterated once, before ht.step()",
                             "iterate `for mb in step` once per step")
        step.started = True
        while True:   # attempts of the step by all ranks together
            outcome = yield from self._rank_pass(step)
            table = self._exchange(outcome)
            if table.any("fatal"):
                raise HetrainError(_fatal_message(table, self.plan),
                                   "hetrain.init(checkpointing='all') (activation checkpointing), "
                                   "sharding='fsdp', a smaller model or sequence, or a device with more memory")
            self._amend_micro_batches(table, step)
            if not table.any("desync"):
                break
            # Agreed by all: an OOM broke a gradient sync; discard the step and redo it.
            self.redone_steps += 1
            self._optimizer.zero_grad(set_to_none=True)
            recovery.reset_reducer(self._ddp)
        self._table = table

    def _rank_pass(self, step: Step):
        """This rank's micro-batches of the step; an OOM here is handled locally (recovery.py)."""
        share = self.plan.devices[self.rank].share
        self._micro = self.plan.devices[self.rank].micro_batch
        while True:
            self._busy_s, self._compute_s = 0.0, 0.0
            self._count = torch.zeros((), dtype=torch.float64, device=self.device)
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            self._cuda_times = []    # (start, before backward, after backward) events, CUDA only
            sizes = split_evenly(share, math.ceil(share / self._micro))
            start, failed = 0, None
            for k, size in enumerate(sizes):
                chunk = step.indices[start:start + size]
                start += size
                mb = MicroBatch(batch=self._load(chunk), size=size, index=k, count=len(sizes), indices=chunk,
                                catch_oom=self.config.oom_recovery)
                oom = self.faults.oom(step.index, k, len(sizes), "forward", escape=0) if self.faults else None
                mb.inject_forward_oom = oom
                self._mb = mb
                if mb.last and self._guard is not None:
                    self._guard.begin()
                sync = contextlib.nullcontext() if mb.last else self._ddp.no_sync()
                busy0 = self._busy()
                mb.started_at = self._clock()
                mb.events = self._cuda_event()
                with sync:
                    yield mb
                spent = self._clock() - mb.started_at
                if self.emulated is not None:   # what ran after backward(); forward+backward are booked
                    self.emulated.throttle.charge(spent - mb.booked_cpu)
                self._compute_s += spent
                self._busy_s += self._busy() - busy0
                if mb.failed is not None:
                    failed = mb
                    break
                if not mb.backward_done:
                    raise UsageError(f"micro-batch {k} of step {step.index} ended without ht.backward(loss)",
                                     "call ht.backward(loss) once inside every micro-batch")
            self._mb = None
            if failed is None:
                return "ok"
            self.ooms += 1
            if self.emulated is not None:   # the failed attempt's sleep belongs to it, not to the redo
                self.emulated.throttle.settle()
            smaller = recovery.smaller_micro_batch(self._micro)
            self.log.warn(f"rank {self.rank} ({self.device_label}): out of memory in micro-batch "
                          f"{failed.index + 1}/{failed.count} ({failed.failed}) of step {step.index}; "
                          + (f"micro-batch {self._micro} -> {smaller}, redoing" if smaller else "cannot shrink"))
            if smaller is None:
                if not failed.desynced:   # peers are waiting in this step's gradient sync: join it
                    self._guard.begin()
                    self._guard.complete_missing()
                return "fatal"
            self._micro = smaller
            if failed.desynced:
                return "desync"
            self._optimizer.zero_grad(set_to_none=True)
            # The failed forward may have run DDP's pre-forward buffer broadcast (it does, in a
            # step's first forward) without its post-forward: the redo must not broadcast again,
            # or this rank would be one collective ahead of its peers.
            if hasattr(self._ddp, "require_forward_param_sync"):
                self._ddp.require_forward_param_sync = False

    def _exchange(self, outcome: str) -> agree.Table:
        loss_sum, units = float(self._loss_sum), float(self._count)    # one device sync per step
        values = (units, loss_sum, self._compute_s, self._cuda_busy() if self._cuda_times else self._busy_s,
                  self._fixed_s, self._micro, outcome == "desync", outcome == "fatal", self.plan.version)
        return agree.exchange(dict(zip(agree.STEP_KEYS, values)),
                              rank=self.rank, world_size=self.world_size, device=self.device)

    # -- compute time on CUDA: events, read after the step's sync (none added per micro-batch) --
    def _cuda_event(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return [ev]

    def _cuda_mark(self, mb: MicroBatch) -> None:
        if mb.events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            mb.events.append(ev)
            if len(mb.events) == 3:
                self._cuda_times.append((mb.last, mb.events))

    def _cuda_busy(self) -> float:
        """GPU seconds in forward + backward. The last micro-batch's backward also waits for the
        gradient sync, so its backward is taken as its forward times the backward/forward ratio of
        the other micro-batches (2 when there are none)."""
        ms = [(last, s.elapsed_time(f), f.elapsed_time(b)) for last, (s, f, b) in self._cuda_times]
        ratios = [bwd / fwd for last, fwd, bwd in ms if not last and fwd > 0]
        ratio = sum(ratios) / len(ratios) if ratios else 2.0
        return sum(fwd + (fwd * ratio if last else bwd) for last, fwd, bwd in ms) / 1e3

    def _amend_micro_batches(self, table: agree.Table, step: Step) -> None:
        """A new Plan version when any rank's micro-batch shrank (the same on every rank)."""
        versions = set(table.column("version"))
        if len(versions) != 1:
            raise HetrainError(f"ranks run different plan versions {table.column('version')}",
                               "this is a bug in hetrain; please report it with the log")
        micros = [int(m) for m in table.column("micro")]
        devices, changes = list(self.plan.devices), []
        for d, m in zip(self.plan.devices, micros):
            if m != d.micro_batch:
                devices[d.rank] = replace(d, micro_batch=m, max_micro_batch=m)
                changes.append(f"rank {d.rank} micro-batch {d.micro_batch} -> {m}")
        if changes:
            self.plan = self.plan.evolve(
                note=f"out of memory at step {step.index}: " + ", ".join(changes), devices=tuple(devices))
            self.log.info(f"plan v{self.plan.version}: {self.plan.note}")

    def _before_forward(self) -> None:
        mb = self._mb
        if mb is not None and mb.inject_forward_oom is not None:
            fault, mb.inject_forward_oom = mb.inject_forward_oom, None
            raise injected_oom(fault)

    def autocast(self):
        """Autocast to this rank's precision (runtime/precision.py; a no-op for fp32)."""
        return self._precision.autocast(self.device.type)      # [precision] this rank's dtype

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
            # a tensor stays on the device (no sync per micro-batch); it is read at the step's end
            units = tokens.detach().double() if isinstance(tokens, torch.Tensor) else float(tokens)
        else:
            units = float(mb.size)
        factor = reduce.loss_factor(units=units, world_size=self.world_size,
                                    global_batch=self.config.global_batch)
        scaled = self._precision.scale(loss * factor)            # [precision] the job-wide loss scale
        mb.backward_done = True
        throttle = self.emulated.throttle if self.emulated is not None else None
        forward_cpu = self._clock() - mb.started_at
        # sleep first, once per step, before the backward that syncs: see emulate.Throttle
        guess = throttle.before_backward(forward_cpu, settle=mb.last, samples=mb.size) if throttle else 0.0
        self._cuda_mark(mb)
        t0 = self._clock()
        try:
            with (self._backward_fault(mb) if self.faults else contextlib.nullcontext()):
                scaled.backward()
        except torch.OutOfMemoryError as e:
            if not self.config.oom_recovery:
                raise
            mb.failed = f"backward: {e}".splitlines()[0][:200]
            if mb.last and self._guard is not None:   # peers are inside this step's gradient
                self._guard.complete_missing()          # all-reduces: finish ours, with zeros
                mb.desynced = True
        self._cuda_mark(mb)
        backward_cpu = self._clock() - t0
        if throttle:
            throttle.after_backward(forward_cpu, guess, backward_cpu)
        mb.booked_cpu = forward_cpu + backward_cpu
        if mb.failed is None:
            self._count += units
            self._loss_sum += loss.detach().double() * units

    @contextlib.contextmanager
    def _backward_fault(self, mb: MicroBatch):
        """Injected faults strike from a parameter's gradient hook halfway through the model, so
        part of the gradient sync has already started, as with a real OOM or crash in backward."""
        oom = self.faults.oom(self._step.index, mb.index, mb.count, "backward", escape=0)
        die = mb.last and self.faults.due("die", self._step.index, phase="backward")
        if oom is None and not die:
            yield
            return
        params = [p for p in self._model.module.parameters() if p.requires_grad]

        def boom(grad):
            if die:
                self.faults.maybe_die(self._step.index, "backward")
            raise injected_oom(oom)

        handle = params[len(params) // 2].register_hook(boom)
        try:
            yield
        finally:
            handle.remove()

    def step(self) -> Step:
        """Finish the step: correct token weighting, clip, optimizer step, zero gradients; then
        rebalance, log samples and checkpoint when due."""
        step, table = self._step, self._table
        if step is None or table is None:
            raise UsageError("ht.step() called before the step's micro-batches all ran",
                             "run `for mb in step: ...` to the end, then call ht.step()")
        busy0 = self._busy()
        opt, cfg = self._optimizer, self.config
        self._precision.unscale_(opt)     # [precision] unscale; found-inf agreed by all ranks
        total_units = table.sum("units")
        if cfg.loss_weighting == "tokens":
            reduce.scale_gradients(self._model.parameters(), reduce.token_correction(
                global_batch=cfg.global_batch, total_units=total_units))
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self._model.parameters() if p.grad is not None],
                                           cfg.grad_clip)
        throttle = self.emulated.throttle.compute() if self.emulated else contextlib.nullcontext()
        with throttle:
            self._precision.step(opt, step_index=step.index, log=self.log)   # [precision] or agreed skip
        opt.zero_grad(set_to_none=True)
        if self.emulated is not None and not self._state_counted and _has_state(opt):
            self.emulated.meter.set_fixed(self._model.module, opt)  # optimizer state now exists
            self._state_counted = True

        now = time.perf_counter()
        elapsed, self._step_started = now - self._step_started, now
        step.loss = table.sum("loss_sum") / total_units
        step.samples_per_s = cfg.global_batch / elapsed
        self._stats.add(loss=step.loss, seconds=elapsed, busy=table.column("busy_s"),
                        compute=table.column("compute_s"))
        self.steps_done += 1
        self._step, self._table = None, None
        if cfg.sample_log:
            persist.log_samples(self, step)
        self._fixed_s = self._busy() - busy0
        if self._rebalancer is not None:
            self._rebalancer.observe(self.plan, busy_s=table.column("busy_s"), fixed_s=table.column("fixed_s"))
            decision = self._rebalancer.propose(self.plan, step=self.steps_done)
            if decision is not None:
                self.plan = decision.plan
                self.rebalances += 1
                self.log.info(decision.message)
        # Saved at the boundary, once the user's end-of-step code (an LR scheduler step, say) ran.
        self._checkpoint_due = self._checkpointer is not None and (
            self.steps_done % cfg.checkpoint_every == 0 or self.steps_done == self.total_steps)
        return step

    def _at_boundary(self) -> None:
        """Between two steps (and after the last): save the checkpoint if one is due."""
        if self._checkpoint_due:
            self._checkpoint_due = False
            persist.save(self)

    # -- the end ------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Run figures (same on every rank); rank 0 prints them with every rank side by side.
        A collective: every rank calls it."""
        st = self._stats
        timed, seconds, busy, compute = st.timed()
        mine = {"busy_s": busy[self.rank], "compute_s": compute[self.rank], "ooms": self.ooms,
                "peak_bytes": float(self.emulated.meter.peak) if self.emulated else
                (float(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else 0.0)}
        table = agree.exchange(mine, rank=self.rank, world_size=self.world_size, device=self.device)
        out = {
            "steps": st.steps,
            "samples_per_s": (timed * self.config.global_batch / seconds) if seconds else None,
            "first_loss": st.first_loss,
            "last_loss": st.last_loss,
            "plan_version": self.plan.version if self.plan else None,
            "shares": list(self.plan.shares) if self.plan else [],
            "micro_batches": [d.micro_batch for d in self.plan.devices] if self.plan else [],
            "max_micro_batches": [d.max_micro_batch for d in self.plan.devices] if self.plan else [],
            "predicted": dict(self.plan.predicted) if self.plan else {},
            "predicted_compute_s": [d.predicted_compute_s for d in self.plan.devices] if self.plan else [],
            "profiles": [p.to_dict() for p in self.profiles] if self.profiles else [],
            "redone_steps": self.redone_steps,
            "rebalances": self.rebalances,
            "ranks": [table.row(r) for r in range(self.world_size)],
        }
        if st.steps and self.plan is not None:
            rows = []
            for d in self.plan.devices:
                r = out["ranks"][d.rank]
                rows.append((d.rank, d.device, d.share, d.micro_batch,
                             f"{r['busy_s'] / max(timed, 1) * 1000:.0f} ms",
                             f"{r['busy_s'] / seconds:.0%}" if seconds else "-",
                             format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-", int(r["ooms"])))
            sps = f"{out['samples_per_s']:.1f}" if out["samples_per_s"] else "-"
            self.log.table(
                f"summary: {st.steps} steps, {sps} samples/s, loss {out['first_loss']:.4f} -> "
                f"{out['last_loss']:.4f}, plan v{self.plan.version}" + (" (emulated devices)" if self.emulated else ""),
                ("rank", "device", "share", "micro", "busy/step", "busy", "peak memory", "OOMs"), rows)
        out["precision"] = self._precision.summary()                 # [precision] skipped steps
        out["host"] = self.host.to_dict() if self.host is not None else None
        self._precision.show_summary(self.log, steps=st.steps)
        out["memory"] = memory.report(plan=self.plan, memory_plan=self._memory_plan, rank=self.rank,  # [memory]
                                      world_size=self.world_size, device=self.device,
                                      emulated=self.emulated, log=self.log)
        return out

    def close(self) -> None:
        """Leave the process group cleanly (a collective: every rank calls it)."""
        if self._closed:
            return
        self._at_boundary()     # a checkpoint due after the last step taken (the loop may have broken off)
        self._closed = True
        self._release()
        shutdown(self.ctx)

    def _at_exit(self) -> None:
        """An interpreter exit without close() (an error the script caught, say): free the DDP
        wrapper before the process group goes, which is what stops gloo aborting at exit (SIGABRT,
        TORCH-CPU-FACTS). No barrier: peers may be gone."""
        if self._closed:
            return
        self._closed = True
        self._release()
        gc.collect()
        if self.ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _release(self) -> None:
        gc.unfreeze()
        if self._model is not None:
            self._model.release_wrapper()
        self._ddp = self._guard = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:   # peers may be gone: no barrier, just release what we hold
            self._at_exit()


class _RunStats:
    """What the summary needs, kept as running sums (not a per-step history)."""

    def __init__(self, world_size: int):
        self.steps = 0
        self.timed_steps = 0            # steps after the first (which includes warm-up)
        self.seconds = 0.0
        self.busy = [0.0] * world_size
        self.compute = [0.0] * world_size
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._first: tuple[float, list[float], list[float]] | None = None

    def add(self, *, loss: float, seconds: float, busy: list[float], compute: list[float]) -> None:
        self.steps += 1
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        if self.steps == 1:             # kept aside: used only when it is the only step
            self._first = (seconds, list(busy), list(compute))
            return
        self.timed_steps += 1
        self.seconds += seconds
        self.busy = [a + b for a, b in zip(self.busy, busy)]
        self.compute = [a + b for a, b in zip(self.compute, compute)]

    def timed(self) -> tuple[int, float, list[float], list[float]]:
        """(steps, seconds, busy, compute) over the steps after the first, or the first alone."""
        if self.timed_steps == 0 and self._first is not None:
            return (1, *self._first)
        return self.timed_steps, self.seconds, self.busy, self.compute


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds state yet (wrappers such as ZeRO keep it in `.optim`)."""
    inner = getattr(optimizer, "optim", None)
    return bool(optimizer.state) or (isinstance(inner, torch.optim.Optimizer) and bool(inner.state))


def _fatal_message(table: agree.Table, plan: Plan) -> str:
    ranks = [r for r, v in enumerate(table.column("fatal")) if v]
    who = ", ".join(f"rank {r} ({plan.devices[r].device})" for r in ranks)
    return f"out of memory with a micro-batch of 1 sample on {who}: the model does not fit there"


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
