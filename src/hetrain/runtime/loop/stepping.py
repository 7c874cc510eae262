"""One optimizer step, as the user's loop drives it: this rank's micro-batches, the weighted
backward, the step's agreement, the optimizer step, then rebalancing and checkpoints.

    begin_step()      the step's global batch, and this rank's slice of it by the plan
    micro_batches()   this rank's share in micro-batches that fit; the last one syncs gradients
                      (DDP all-reduces exactly once per step: every micro-batch but the last runs
                      under no_sync(), forward included — with backward alone inside no_sync,
                      DDP syncs every micro-batch and unequal counts deadlock)
    backward()        weighted so the step's gradient is the big-batch gradient (runtime/loop/reduce.py)
    finish()          agreement done: clip, optimizer step (or the agreed skip), rebalance

Each step ends with one small all-reduce of a table of every rank's figures (runtime/ranks/agree.py): loss and
counts, timings, out-of-memory events, micro-batch sizes. Everything that changes what ranks do
next — redo a step after an OOM, a new Plan after an OOM or a rebalance, stop together — is
decided from that table, identically on every rank. An OOM is handled as runtime/resilience/oom.py describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..devices import clock as clocks
from ...errors import DoesNotFit, HetrainError, Preempted, UsageError
from ..ranks import agree
from ..resilience import resume as persist
from ..resilience import oom as recovery
from ..resilience import preempt
from . import reduce
from ..job import Job
from ..replan import check_unchanged, replan
from .steps import MicroBatch, Step

FATAL_FIX = ("hetrain.init(memory=Memory(activation_checkpointing='all')), parallel=hetrain.DataParallel(sharding='fsdp'), a smaller "
             "model or sequence, or a device with more memory")


@dataclass
class StepState:
    """What one step accumulates on this rank, made afresh for each attempt of the step."""

    step: Step
    micro: int                                       # this rank's micro-batch size in this attempt
    count: torch.Tensor = None                       # samples (or tokens) of the successful micro-batches
    loss_sum: torch.Tensor = None                    # Σ loss · units, on the device (read once per step)
    mb: MicroBatch | None = None                     # the micro-batch in the user's hands
    table: agree.Table | None = None                 # the step's agreement, once every rank has reported
    period_s: float = 0.0                            # wall time from the previous agreement to this one


class StepLoop:
    """The loop's machinery for one rank; Steps/Step (runtime/loop/steps.py) call it, the Engine's verbs too."""

    def __init__(self, job: Job):
        self.job = job
        self.run = job.run             # the run state (plan in force, sampler, counters): the loop's
        self.state: StepState | None = None
        self.step_started = 0.0        # wall clock at the end of the previous step
        self.checkpoint_due = False
        self.on_step = None            # called with (step, table, elapsed) once a step is done
        self.stop_signals = None       # every rank's stop signal, once a stop was agreed (preempt.py)
        self.clip_hook = None          # an integration's clip, (job, step), on the final gradient (fabric.clip_gradients)

    # -- the step -------------------------------------------------------------------------------
    def begin_step(self) -> Step:
        job = self.job
        if self.state is not None:
            raise UsageError(f"step {self.state.step.index} has no ht.step() call",
                             "call ht.step() once after each step's micro-batches")
        check_unchanged(job)           # a plan changed in place since it was adopted: refused here
        self.at_boundary()
        job.hooks.step_start(job.steps_done)
        samples = job.sampler.next_step()
        if self.step_started == 0.0:
            self.step_started = clocks.host()
        indices, epochs = samples.for_rank(job.plan.offsets(), job.plan.shares, job.rank)
        step = Step(index=samples.step, epoch=samples.epoch, indices=indices, epochs=epochs, loop=self)
        self.state = StepState(step=step, micro=job.plan.devices[job.rank].micro_batch)
        return step

    def micro_batches(self, step: Step):
        job, state = self.job, self.state
        if state is None or step is not state.step or step.started:
            raise UsageError("a step's micro-batches can be iterated once, before ht.step()",
                             "iterate `for mb in step` once per step")
        step.started = True
        while True:   # attempts of the step by all ranks together
            outcome = yield from job.layout.rank_pass(self, state)   # runtime/layouts/
            table = self._exchange(state, outcome)
            if table.any("fatal"):
                _record(job, "oom_fatal", step=step.index, table=table)
                raise DoesNotFit(_fatal_message(table, job.plan), FATAL_FIX)
            self._amend_micro_batches(table, step)
            state.micro = job.plan.devices[job.rank].micro_batch    # a redo runs the amended plan (a pipeline: all its stages)
            job.log.flush_if(table)
            if not table.any("desync"):
                break
            # Agreed by all: an OOM broke a gradient sync; discard the step and redo it.
            job.run.redone_steps += 1
            job.layout.redo(job)
        state.table = table
        # Agreement to agreement: every rank's micro-batches of the step lie inside this period
        # (finish()'s `elapsed`, finish to finish, also holds this rank's optimizer step jitter).
        now = clocks.host()
        state.period_s, job.run.met_at = now - job.met_at, now

    def _exchange(self, state: StepState, outcome: str) -> agree.Table:
        job = self.job
        clocks.synchronize(job.device)        # the step's sync: the events below are read after it
        loss_sum, units = float(state.loss_sum), float(state.count)
        if not job.layout.reports_loss(job):   # another rank of its replica reports the same samples
            loss_sum = units = 0.0
        values = (units, loss_sum, job.hooks.attempt_compute_s(), job.hooks.attempt_busy_s(), job.hooks.last_fixed_s(),
                  state.micro, outcome == "desync", outcome == "fatal", job.plan.version, job.log.pending,
                  job.preemption.requested, job.hooks.attempt_sync_s(), job.hooks.step_peak_bytes())
        return agree.exchange(dict(zip(agree.STEP_KEYS, values)),
                              rank=job.rank, world_size=job.world_size, device=job.device)

    def _amend_micro_batches(self, table: agree.Table, step: Step) -> None:
        """A new Plan version when any rank's micro-batch shrank (the same on every rank)."""
        job = self.job
        if len(set(table.column("version"))) != 1:
            raise HetrainError(f"ranks run different plan versions {table.column('version')}",
                               "this is a bug in hetrain; please report it with the log")
        micros = [int(m) for m in table.column("micro")]
        g = job.plan.group        # the ranks of a pipeline or TP group run one micro-batch size
        micros = [min(micros[(r // g) * g:(r // g + 1) * g]) for r in range(len(micros))]
        devices, changes = list(job.plan.devices), []
        for d, m in zip(job.plan.devices, micros):
            if m != d.micro_batch:
                devices[d.rank] = replace(d, micro_batch=m, max_micro_batch=m)
                changes.append(f"rank {d.rank} micro-batch {d.micro_batch} -> {m}")
        if changes:
            before = job.plan
            replan(job, job.plan.evolve(
                note=f"out of memory at step {step.index}: " + ", ".join(changes), devices=tuple(devices)), "OOM")
            job.log.info(f"plan v{job.plan.version}: {job.plan.note}")
            _record(job, "oom", step=step.index, before=before, redone=table.any("desync"))

    # -- backward -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, tokens) -> None:
        job, state = self.job, self.state
        mb = state.mb if state is not None else None
        if mb is None or mb.backward_done:
            raise UsageError("ht.backward() called outside a micro-batch, or twice for one",
                             "call ht.backward(loss) once inside each `for mb in step` iteration")
        units = reduce.units(job.config.loss_weighting, size=mb.size, tokens=tokens)
        if job.layout.deferred:    # a pipeline: the schedule runs this backward with the others
            job.layout.record(job, mb, loss, units)
            mb.backward_done = True
            return
        # the synchroniser averages over the replicas (DDP, FSDP2: every rank; TP: nothing to average)
        factor = reduce.loss_factor(units=units, world_size=job.plan.replicas, global_batch=job.config.global_batch)
        scaled = job.precision.scale(loss * factor)               # the job-wide loss scale (fp16)
        mb.backward_done = True
        job.hooks.before_backward(mb)
        t0, mark = job.hooks.clock(), job.hooks.wall_mark(mb)
        try:
            with job.hooks.backward_scope(mb, state.step.index, job.model.module):
                scaled.backward()
            job.hooks.backward_wall(mark, job.hooks.clock() - t0)
        except torch.OutOfMemoryError as e:
            if not job.config.memory.oom_recovery:
                raise
            mb.failed = f"backward: {e}".splitlines()[0][:200]
        if mb.failed is not None:
            # Out of the except block, whose traceback held the failed graph: release it before
            # anything allocates (runtime/resilience/oom.py).
            recovery.release_graph(job.device, scaled, loss)
            del scaled
            if mb.last and job.guard is not None:    # peers are inside this step's gradient
                job.optimizer.zero_grad(set_to_none=True)   # all-reduces: the step is abandoned
                recovery.free_cached(job.device)
                job.guard.complete_missing()           # finish ours, with zeros
                mb.desynced = True
        job.hooks.after_backward(mb, job.hooks.clock() - t0)
        if mb.failed is None:
            state.count += units
            state.loss_sum += loss.detach().double() * units

    # -- the end of the step --------------------------------------------------------------------
    def finish(self, *, optimizer_step: bool = True) -> Step:
        """Token correction, clip, optimizer step (or the agreed skip), zero gradients; then
        rebalance, log samples and mark a checkpoint due. optimizer_step=False (agreed by every
        rank): the gradient is kept for the next step to add to (a script's own accumulation)."""
        job, state = self.job, self.state
        if state is None or state.table is None:
            raise UsageError("ht.step() called before the step's micro-batches all ran",
                             "run `for mb in step: ...` to the end, then call ht.step()")
        step, table, cfg, opt = state.step, state.table, job.config, job.optimizer
        total_units = table.sum("units")
        stepped = False
        job.hooks.fixed_start()                    # the optimizer's part, on the device's clock
        if optimizer_step:
            job.precision.unscale_(opt)            # unscale; found-inf agreed by all ranks
            if cfg.loss_weighting == "tokens":
                reduce.scale_gradients(job.model.parameters(), reduce.token_correction(
                    global_batch=cfg.global_batch, total_units=total_units))
            if cfg.grad_clip is not None:
                job.layout.clip(job, cfg.grad_clip)
            if self.clip_hook is not None:
                self.clip_hook(job, step)
            with job.hooks.optimizer():
                stepped = job.precision.step(opt, step_index=step.index, log=job.log)    # or the agreed skip
            opt.zero_grad(set_to_none=True)
            job.hooks.after_optimizer(job.layout.held(job), opt)
        elif cfg.loss_weighting == "tokens":     # each step's correction would scale the steps before it too
            raise UsageError("a step without its optimizer step (the gradient kept for the next) under "
                             "loss_weighting='tokens'", "step the optimizer every step, or weight by samples")
        job.hooks.fixed_end()

        now = clocks.host()
        elapsed, self.step_started = now - self.step_started, now
        step.loss = table.sum("loss_sum") / total_units
        step.samples_per_s = cfg.global_batch / elapsed
        if self.on_step is not None:
            self.on_step(step, table, elapsed, job.plan.shares)
        _record(job, "step", step=step, table=table, period=state.period_s, stepped=stepped)
        job.run.steps_done += 1
        self.state = None
        if cfg.reporting.sample_log:
            persist.log_samples(job, step)
        if job.rebalancer is not None:
            job.rebalancer.observe(job.plan, busy_s=table.column("busy_s"), fixed_s=table.column("fixed_s"))
            decision = job.rebalancer.propose(job.plan, step=job.steps_done)
            if decision is not None:
                _record(job, "rebalance", step=step.index, before=job.plan, after=decision.plan,
                        message=decision.message)
                replan(job, decision.plan, "rebalanced")
                job.run.rebalances += 1
                job.log.info(decision.message)
        # Saved at the boundary, once the user's end-of-step code (an LR scheduler step, say) ran.
        stop = table.any("stop")       # a rank got SIGTERM/SIGINT: all stop after this step (preempt.py)
        # (not while a gradient is kept for the next step: a checkpoint does not hold it)
        self.checkpoint_due = job.checkpointer is not None and (stop or optimizer_step and (
            job.steps_done % cfg.checkpoints.every == 0 or job.steps_done == job.total_steps))
        if stop:
            self.stop_signals = table.column("stop")
            job.preemption.at_boundary = True
        return step

    def at_boundary(self) -> None:
        """Between two steps (and after the last): save the checkpoint if one is due; after an
        agreed stop, leave (every rank raises the same Preempted) unless the run is complete."""
        job, saved = self.job, None
        if self.checkpoint_due:
            self.checkpoint_due = False
            saved = str(persist.save(job))
            job.preemption.last_saved = saved
        if self.stop_signals is not None and job.steps_done < job.total_steps:
            raise Preempted(preempt.stop_message(signals=self.stop_signals, step=job.steps_done, saved=saved))



def _record(job: Job, what: str, **facts) -> None:
    """The run's record (runtime/loop/metrics.py: metrics.jsonl and status lines, rank 0), when prepare() made one."""
    if job.recorder is not None:
        job.recorder.record(what, **facts)


def _fatal_message(table: agree.Table, plan) -> str:
    ranks = [r for r, v in enumerate(table.column("fatal")) if v]
    who = ", ".join(f"rank {r} ({plan.devices[r].device})" for r in ranks)
    return f"out of memory with a micro-batch of 1 sample on {who}: the model does not fit there"
