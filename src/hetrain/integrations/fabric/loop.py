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
at the halved micro-batch). An OOM in fabric.backward is recovered here as in the step form: the
micro-batch is halved and the loader yields the redone micro-batches.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...errors import HetrainError, UsageError
from ...runtime.resilience.oom import record_escaped_oom

NOT_PULLED = object()     # the next micro-batch has not been asked of hetrain's step yet


class ForwardOutOfMemory(HetrainError):
    """A forward in Fabric's own loop ran out of memory: every rank stopped together."""

    agreed = True          # every rank raises it at the same agreement, with the same text


class PlainLoop:
    """The plain loop's state on this rank: the step in progress, the micro-batch in the user's
    hands, and the one optimizer.step() pulled ahead (a redo after an OOM)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.micro_batches = None        # hetrain's generator of this rank's micro-batches of the step
        self.mb = None                   # the micro-batch yielded to the user
        self.pulled = NOT_PULLED         # what optimizer.step() pulled after it: a micro-batch, or None (done)
        self.finished = None             # the step optimizer.step() finished (hetrain's Step)
        self.escaped = None              # (micro-batch, the plan's micro-batch size) whose forward ran out of memory

    @property
    def active(self) -> bool:
        """Inside a global step (the loop left before its optimizer.step() leaves it so)."""
        return self.micro_batches is not None and self.finished is None

    # -- one pass: one epoch ------------------------------------------------------------------------
    def steps_in_pass(self, job) -> int:
        """The steps until the sampler's stream reaches the next epoch."""
        sampler = job.sampler
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
        self.micro_batches = self.mb = None
        job, loop = self.strategy.engine.job, steps.loop
        n = self.steps_in_pass(job)
        if not self.strategy.run_length_given:    # the user's loop decides the run's length, an epoch a pass
            job.total_steps = max(job.total_steps, job.steps_done + n)
        end = min(job.total_steps, job.steps_done + n)
        while job.steps_done < end:
            step = loop.begin_step()
            self.micro_batches, self.finished = iter(step), None
            mb = self.pull()
            if mb is None:       # no samples for this rank in this step: its part is the agreement alone
                self.finish_step()
            while mb is not None:
                self.mb, self.pulled = mb, NOT_PULLED
                yield mb.batch
                if self.finished is not None:          # optimizer.step() took the global step
                    break
                if self.pulled is NOT_PULLED:           # optimizer.step() was not called for this batch
                    self.check_backward(mb)
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
        mb = next(self.micro_batches, None)
        if engine.redone_steps != redone:   # every rank agreed, just now, to redo the step: all are here
            self.agree_escapes()
        return mb

    # -- an OOM in a forward, which this loop cannot redo ----------------------------------------------
    def forward_oom(self, error: torch.OutOfMemoryError) -> None:
        """Called by the model's forward on an OOM (the caller re-raises it if this returns): settle
        this rank's part of the step with its peers, then every rank stops with one error."""
        job = self.strategy.engine.job
        mb, guard = self.mb, job.guard
        if not self.active or mb is None or mb.failed is not None or guard is None:
            return           # outside the plain loop, or no peers to settle with (or recovery off)
        micro = job.micro_batch
        if not guard.every_oom_desyncs:     # DDP: the peers' last backward all-reduces; ours, with zeros
            guard.begin()
            guard.complete_missing()
            mb.desynced = True              # (FSDP2's guard completes its own collectives in the agreement)
        mb.failed = f"forward: {error}".splitlines()[0][:200]
        mb.backward_done = True
        self.escaped = (mb, micro)
        self.pull()     # the agreement (an OOM at a micro-batch of 1 stops every rank there instead)
        raise HetrainError("the step's agreement did not redo the step after an OOM in a forward",
                           "this is a bug in hetrain; please report it with the log")

    def agree_escapes(self) -> None:
        """At a redo every rank agreed: does any rank's loop hold a forward that ran out of memory?"""
        engine = self.strategy.engine
        flags = torch.zeros(engine.world_size, dtype=torch.int32, device=engine.device)
        flags[engine.rank] = self.escaped is not None
        dist.all_reduce(flags)                                                  # (collective)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if not ranks:
            return
        job = engine.job
        if self.escaped is not None and job.checkpointer is not None:     # a restart halves this rank's micro-batch
            record_escaped_oom(str(job.checkpointer.dir), rank=engine.rank, micro=self.escaped[1] or 1,
                               step=job.steps_done)
        who = ", ".join(f"rank {r} ({job.plan.devices[r].device})" for r in ranks)
        raise ForwardOutOfMemory(
            f"out of memory in a forward on {who} at step {job.steps_done}: Fabric's own loop (`for batch in "
            "loader`) cannot redo a forward, so every rank stopped here",
            "use the step form, which redoes it with a halved micro-batch (`for step in fabric.strategy.steps(): "
            "for mb in step: with mb: ...`), or cap the micro-batch with HetrainStrategy(memory=Memory("
            "max_micro_batch=N)); under `hetrain run --max-restarts N` with a checkpoint_dir the job restarts from "
            "its last checkpoint with the halved micro-batch")

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
