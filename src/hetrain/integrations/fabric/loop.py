"""Fabric's own loop on hetrain's steps:

    for epoch in range(2):
        for batch in loader:             # this rank's micro-batches of each global step, in turn
            optimizer.zero_grad()        # a no-op inside the global step: the gradient accumulates
            fabric.backward(loss_of(batch))   # weighted by the micro-batch's size (the big-batch math)
            optimizer.step()             # a no-op until this rank's last micro-batch of the step;
                                         # then the agreed global step (ht.step), returning it

One pass over the loader is one epoch of hetrain's sampler: the steps until the stream crosses into
the next epoch's permutation (a step that runs past the end of an epoch takes its missing samples
from the next one's start, unless the DataLoader says drop_last=True), so `for epoch in range(2)`
trains twice the steps of one, as stock Fabric does. HetrainStrategy(max_steps=...) or (epochs=...)
caps the run: a pass after the last step yields nothing (which is also how a resumed run ends
where it would have).

What this loop cannot do that `for step in fabric.strategy.steps(): for mb in step: with mb:` does:
redo a micro-batch whose forward ran out of memory. The forward runs in the user's loop body, so
the error leaves the loop. It does not strand the peers: before it leaves, the rank completes its
part of the step's gradient sync with zeros and reports the OOM in the step's agreement, as an OOM
inside a sync is reported (every rank halves its micro-batch in the plan and turns to redo the
step); at that redo every rank of the plain loop agrees one more flag, finds the rank that cannot
redo, and all raise the same ForwardOutOfMemory (a restart from the last checkpoint runs that rank
at the halved micro-batch). A loop body that leaves mid-step for any other reason (an error, a
break before optimizer.step()) is settled the same way when Python closes the loader's iterator
(or, where the script still holds it as the process ends, at exit), and the peers raise
LoopStopped naming the rank. An OOM in fabric.backward is recovered here as in
the step form: the micro-batch is halved and the loader yields the redone micro-batches.

fabric.clip_gradients (Clipping, at the end), by value (clip_val=) or by norm (max_norm=), clips
the step's gradient as stock does. Stock Fabric clips right after fabric.backward, where DDP has
averaged the gradient over the ranks. Under hetrain a batch of Fabric's loop is one micro-batch of
this rank's share, and the step's gradient is final only inside the step: after the last
micro-batch's sync, the unscale of the job's loss scale and the token correction. So a call inside
a step records what it asks, and the step applies it there, just before the optimizer step (the
last call of the step counts; a stock loop asks the same every batch). Clipping the final gradient
by value is an elementwise clamp and by norm one scale of the whole gradient, the same numbers
stock clips. max_norm returns a tensor that the step fills with the gradient's total norm before
clipping, stock's return value: read it after optimizer.step(). A rank without samples in a step
(no batch to call it from) clips as it did the step before, which is what its peers ask.
"""

from __future__ import annotations

import atexit
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import HetrainError, UsageError
from ...runtime.resilience.oom import free_cached, record_escaped_oom

NOT_PULLED = object()     # the next micro-batch has not been asked of hetrain's step yet


class LoopStopped(HetrainError):
    """A rank left Fabric's own loop in the middle of a global step: every rank stopped together."""

    agreed = True          # every rank raises it at the same agreement, with the same text


class ForwardOutOfMemory(LoopStopped):
    """A forward in Fabric's own loop ran out of memory: every rank stopped together."""


FORWARD_OOM, LEFT = 1, 2       # what a rank reports at the redo: why it cannot go on
WHY = {FORWARD_OOM: "ran out of memory in a forward",
       LEFT: "left the loop in the middle of the step (an error in its loop body, or a break before optimizer.step())"}


class PlainLoop:
    """The plain loop's state on this rank: the step in progress, the micro-batch in the user's
    hands, and the one optimizer.step() pulled ahead (a redo after an OOM)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.micro_batches = None        # hetrain's generator of this rank's micro-batches of the step
        self.mb = None                   # the micro-batch yielded to the user
        self.pulled = NOT_PULLED         # what optimizer.step() pulled after it: a micro-batch, or None (done)
        self.finished = None             # the step optimizer.step() finished (hetrain's Step)
        self.escaped = None              # (why, the plan's micro-batch size): this rank cannot go on in the step
        self.broken = False              # the step ended in an error every rank raised: nothing left to settle
        self.forwards = 0                # forwards through the model since this step (or its agreed redo) began
        self.exit_handler = False        # settle_at_exit registered (at the first pass)

    @property
    def active(self) -> bool:
        """Inside a global step (the loop left before its optimizer.step() leaves it so)."""
        return self.micro_batches is not None and self.finished is None

    def count_forward(self) -> None:
        """A forward through the prepared model (a loop body that leaves after one is settled)."""
        self.forwards += 1

    # -- one pass: one epoch ------------------------------------------------------------------------
    def steps_in_pass(self, engine) -> int:
        """The steps until the sampler's stream reaches the next epoch."""
        sampler = engine.sampler
        if sampler.dataset_len is None:   # a stream without a length: its passes cannot be counted ahead,
            return engine.total_steps - engine.steps_done    # so one pass is the run (max_steps, required)
        left, batch = sampler.dataset_len - sampler.cursor, sampler.global_batch
        if sampler.drop_last:
            return (sampler.dataset_len if left < batch else left) // batch
        return math.ceil(left / batch)

    def epoch(self, steps):
        """The batches of one pass (a generator): each of this rank's micro-batches of each step."""
        if self.active:
            raise UsageError("a new pass over the training loader began inside a global step (the previous "
                             "`for batch in loader` was left before its step's optimizer.step())",
                             "leave `for batch in loader` only after optimizer.step(), or use the step form "
                             "`for step in fabric.strategy.steps()`")
        if not self.exit_handler:
            # A script that keeps the loader's iterator (`it = iter(loader)`) and raises out of the
            # whole script leaves it open: the traceback Python keeps for the exit holds it, so the
            # generator is not closed before the process ends. At exit the step is settled all the
            # same, before the engine's own exit handler releases the job (atexit runs last-in first,
            # and the engine registered its handler when it started, before this first pass).
            atexit.register(settle_at_exit, weakref.ref(self))
            self.exit_handler = True
        self.micro_batches = self.mb = None
        engine, loop = self.strategy.engine, steps.loop
        n = self.steps_in_pass(engine)
        if not self.strategy.run_length_given:    # the user's loop decides the run's length, an epoch a pass
            engine.extend_run(n)
        end = min(engine.total_steps, engine.steps_done + n)
        while engine.steps_done < end:
            step = loop.begin_step()
            self.micro_batches, self.finished, self.forwards = iter(step), None, 0
            mb = self.pull()
            if mb is None:       # no samples for this rank in this step: its part is the agreement alone
                self.finish_step()
            while mb is not None:
                self.mb, self.pulled = mb, NOT_PULLED
                try:
                    yield mb.batch
                except GeneratorExit:     # the loop body left: mid-step, its peers must not be stranded
                    self.leave_mid_step()
                    raise
                if self.finished is not None:          # optimizer.step() took the global step
                    break
                if self.pulled is NOT_PULLED:           # optimizer.step() was not called for this batch
                    try:
                        self.check_backward(mb)
                    except UsageError:
                        self.leave_mid_step()           # the peers stop with LoopStopped; this rank says why
                        raise
                    mb = self.pull()
                    if mb is None:
                        raise UsageError(f"step {step.index}: optimizer.step() was not called after this rank's "
                                         "last batch of the global step", "call optimizer.step() after every "
                                         "fabric.backward(loss): hetrain accumulates the micro-batches itself and "
                                         "steps once per global batch")
                else:
                    mb = self.pulled
            self.micro_batches = self.mb = None
        loop.at_boundary()       # a checkpoint due after the pass's last step

    def pull(self):
        """This rank's next micro-batch of the step, or None once every rank agreed the step (an
        OOM on any rank may instead bring the micro-batches of a redo)."""
        engine = self.strategy.engine
        redone = engine.redone_steps
        try:
            mb = next(self.micro_batches, None)
        except BaseException:
            self.broken = True            # (an agreed stop: DoesNotFit; or a lost peer)
            raise
        if engine.redone_steps != redone:   # every rank agreed, just now, to redo the step: all are here
            self.forwards = 0
            self.agree_escapes()
        return mb

    # -- a rank that cannot go on in the step: an OOM in a forward, or a loop body that left -------------
    def forward_oom(self, failed: str) -> None:
        """Called by the model's forward on an OOM, out of its except block (the failed forward's
        graph released; the caller raises the error again if this returns): settle this rank's
        part of the step with its peers; every rank then raises ForwardOutOfMemory."""
        self.settle(FORWARD_OOM, failed)

    def leave_mid_step(self) -> None:
        """The loader's iterator closed inside a step: this rank's own error (if any) goes on, and
        its peers raise LoopStopped."""
        try:
            self.settle(LEFT, "the loop body left the step")
        except (HetrainError, RuntimeError):
            pass          # the agreed stop is the peers' to raise; here the loop body's own error goes on

    def settles(self) -> bool:
        """Would `settle` complete anything with the peers now?"""
        mb = self.pulled if self.pulled not in (NOT_PULLED, None) else self.mb    # the one hetrain runs now
        if self.broken or not self.active or mb is None or self.strategy.engine.oom_guard is None:
            return False     # nothing in flight, no peers to settle with (or OOM recovery off)
        # DDP's first forward of a step may run collectives before the model does (module buffers
        # broadcast; once, its buckets' order), which this rank has not met: its peers wait there,
        # and learn of it when this process exits.
        return self.forwards > 0

    def settle(self, why: int, failed: str) -> None:
        """Complete this rank's part of the step's gradient sync with zeros and report the
        micro-batch failed, as an OOM inside the sync is reported: every rank turns to redo the
        step, and at that redo all raise the same error (agree_escapes)."""
        if not self.settles():
            return
        engine = self.strategy.engine
        guard = engine.oom_guard
        mb = self.pulled if self.pulled not in (NOT_PULLED, None) else self.mb    # the one hetrain runs now
        micro = engine.current_micro_batch
        if not guard.every_oom_desyncs and not mb.desynced:      # DDP (FSDP2's guard settles in the agreement)
            if not (mb.last and mb.backward_done and mb.failed is None):   # its gradient sync not done yet
                engine.optimizer.zero_grad(set_to_none=True)    # the step is redone: its gradients go first
                free_cached(engine.device)
                guard.begin()
                guard.complete_missing()
            mb.desynced = True
        if mb.failed is None:
            mb.failed, mb.backward_done = failed, True
        self.escaped = (why, micro)
        self.pull()     # the agreement (an OOM at a micro-batch of 1 stops every rank there instead)
        self.broken = True
        raise HetrainError("the step's agreement did not redo the step after a rank left it",
                           "this is a bug in hetrain; please report it with the log")

    def agree_escapes(self) -> None:
        """At a redo every rank agreed: can any rank not go on in the step (and why)?"""
        engine = self.strategy.engine
        flags = torch.zeros(engine.world_size, dtype=torch.int32, device=engine.device)
        flags[engine.rank] = self.escaped[0] if self.escaped is not None else 0
        dist.all_reduce(flags)                                                  # (collective)
        why = {r: int(f) for r, f in enumerate(flags.tolist()) if f}
        if not why:
            return
        self.broken = True
        if self.escaped is not None and self.escaped[0] == FORWARD_OOM and engine.checkpoint_dir is not None:
            record_escaped_oom(engine.checkpoint_dir, rank=engine.rank, micro=self.escaped[1] or 1,
                               step=engine.steps_done)    # a restart halves this rank's micro-batch
        who = "; ".join(f"rank {r} ({engine.plan.devices[r].device}) {WHY[w]}" for r, w in why.items())
        if FORWARD_OOM in why.values():
            raise ForwardOutOfMemory(
                f"at step {engine.steps_done}, {who}: Fabric's own loop (`for batch in loader`) cannot redo a forward, "
                "so every rank stopped here",
                "use the step form, which redoes it with a halved micro-batch (`for step in fabric.strategy.steps(): "
                "for mb in step: with mb: ...`), or cap the micro-batch with HetrainStrategy(memory=Memory("
                "max_micro_batch=N)); under `hetrain run --max-restarts N` with a checkpoint_dir the job restarts "
                "from its last checkpoint with the halved micro-batch")
        raise LoopStopped(f"at step {engine.steps_done}, {who}: every rank stopped here",
                          "see that rank's own error; leave `for batch in loader` only after optimizer.step() "
                          "returned the step")

    def check_backward(self, mb) -> None:
        if not mb.backward_done:
            raise UsageError(f"batch {mb.index + 1} of this rank's {mb.count} in step {self.strategy.engine.steps_done} "
                             "went by without fabric.backward(loss)",
                             "call fabric.backward(loss) once for every batch the training loader yields")

    # -- optimizer.step() -----------------------------------------------------------------------------
    def optimizer_step(self):
        """Inside the plain loop: a no-op (None) until this rank's last micro-batch of the step,
        then the agreed global step (hetrain's Step, with the global loss)."""
        mb = self.mb
        if self.finished is not None or self.pulled is not NOT_PULLED:
            raise UsageError("optimizer.step() twice for one batch", "call optimizer.step() once per batch")
        self.check_backward(mb)
        self.pulled = self.pull()
        if self.pulled is not None:
            return None           # more micro-batches of this step (or of its redo) to come
        return self.finish_step()

    def finish_step(self):
        self.finished = self.strategy.engine.step()      # (collective inside: the step's agreement is done)
        return self.finished


def settle_at_exit(ref) -> None:
    """At interpreter exit: a loop still inside a step (its iterator never closed) settles it, so
    the peers raise LoopStopped instead of losing this rank in the gradient sync."""
    loop = ref()
    if loop is None or not loop.active:
        return
    try:
        loop.leave_mid_step()
    except Exception:       # at exit nothing is left to report to (the group may be gone)
        pass


# -- fabric.clip_gradients, applied in the step -------------------------------------------------------
@dataclass(frozen=True)
class Request:
    clip_val: float | None = None
    max_norm: float | None = None
    norm_type: float = 2.0
    error_if_nonfinite: bool = True
    norm: torch.Tensor | None = None      # max_norm: filled in by the step


class Clipping:
    """This rank's clip request for the step in progress, applied by the step (runtime/loop/stepping.py)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.request: Request | None = None
        self.last: Request | None = None

    def ask(self, request: Request) -> torch.Tensor | None:
        strategy = self.strategy
        engine = strategy.joined()
        call = "clip_val" if request.clip_val is not None else "max_norm"
        if engine.config.grad_clip is not None:
            raise UsageError(f"fabric.clip_gradients({call}=...) under HetrainStrategy(grad_clip={engine.config.grad_clip}): "
                             "two clips of one gradient", "drop one: the fabric.clip_gradients call, or grad_clip=")
        if not strategy.in_step():
            raise UsageError(f"fabric.clip_gradients({call}=...) outside a step: under HetrainStrategy the gradient "
                             "of a step is final inside the step, where the call is applied",
                             "call it between fabric.backward(loss) and optimizer.step(), as stock loops do")
        if engine.clips_in_slices and (request.clip_val is not None or request.norm_type != 2):
            raise UsageError(f"fabric.clip_gradients({call}=...{', norm_type=' + str(request.norm_type) if call == 'max_norm' else ''}) "
                             "under sharding='capacity-full': its slices clip only by the 2-norm",
                             "clip with max_norm= and norm_type=2, or HetrainStrategy(sharding='zero1' or 'fsdp')")
        strategy.pieces.steps.loop.clip_hook = self.apply
        if request.max_norm is not None:
            request = Request(max_norm=request.max_norm, norm_type=request.norm_type,
                              error_if_nonfinite=request.error_if_nonfinite,
                              norm=torch.zeros((), device=strategy.engine.device,
                                               dtype=next(engine.model.parameters()).dtype))
        self.request = request
        return request.norm

    def apply(self, _job, step) -> None:
        """In the step: after the gradient is final, before the optimizer step."""
        engine = self.strategy.engine
        request = self.request if self.request is not None or len(step.indices) else self.last
        self.request = None
        if request is None:
            return
        self.last = request
        if request.clip_val is not None:
            grads = [p for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_value_(grads, request.clip_val)
            return
        total = engine.clip_grad_norm(request.max_norm, norm_type=request.norm_type,
                                      error_if_nonfinite=request.error_if_nonfinite)
        total = total.full_tensor() if hasattr(total, "full_tensor") else total     # FSDP2: a DTensor
        request.norm.copy_(total.detach().to(request.norm))
