"""An Accelerate script's own loop on hetrain's steps: what `prepare` hands back.

    for batch in train_dataloader:              # TrainLoader: this rank's micro-batches, step by step
        with accelerator.accumulate(model):     # hetrain already syncs once per step
            loss = model(**batch).loss
            accelerator.backward(loss)          # weighted by the micro-batch's size
            optimizer.step()                    # StepOptimizer: the agreed global step, on the last one
            lr_scheduler.step()                 # StepScheduler: once, after that step
            optimizer.zero_grad()               # hetrain zeroes after its step

A stock rank runs the same number of equal batches as every other and steps every
gradient_accumulation_steps of them. Under hetrain each rank runs its own share of every global
batch in its own number of micro-batches, so the loop is driven by hetrain's steps: iterating the
loader yields this rank's micro-batches of one step after another; `accelerator.sync_gradients` is
True on this rank's last micro-batch of a step, and `optimizer.step()` there finishes the step for
every rank (the agreement, then clip and the optimizer's step). On any other micro-batch it is a
no-op, as stock's is while accumulating. One pass over the loader is one epoch of global steps:
ceil(len(dataset) / global batch) (floor under drop_last), the rest of the epoch after load_state.
Over an IterableDataset without a length (hetrain={'max_steps': N} required) one pass is the run.
"""

from __future__ import annotations

import math

from ...errors import UsageError
from ..fabric.loop import PlainLoop


class Run:
    """The loop's state, shared by the loader, optimizer, scheduler and accelerator. The mechanics
    of a plain loop over hetrain's steps are Fabric's own loop's (fabric/loop.py: one pass an epoch,
    a no-op optimizer.step() until a rank's last micro-batch, an OOM in backward redone, a loop body
    that leaves mid-step settled with the peers, which then raise one LoopStopped); Run is what
    that loop reads of its owner (`engine`, `run_length_given`) plus Accelerate's scheduler rule."""

    def __init__(self, engine, steps, *, run_length_given: bool, accumulation: int):
        self.engine = engine
        self.steps = steps                    # hetrain's Steps
        self.run_length_given = run_length_given   # hetrain={'max_steps' | 'epochs'}; else a pass is an epoch
        self.accumulation = accumulation
        self.plain = PlainLoop(self)
        self.started = False                  # a pass began (load_state must come before)
        self.scheduled = None                 # the step index the scheduler last stepped for
        self.last_loss: float | None = None   # the last finished step's loss over the global batch

    in_step = property(lambda self: self.plain.active)

    @property
    def sync_gradients(self) -> bool:
        """True on this rank's last micro-batch of a step (and outside the training loop)."""
        mb = self.plain.mb if self.plain.active else None
        return mb is None or mb.last

    def step(self) -> None:
        """optimizer.step(): on this rank's last micro-batch, the agreed step for every rank."""
        if not self.plain.active:
            if self.plain.finished is not None and self.plain.micro_batches is not None:
                return              # stepped already in this batch: stock steps once per sync too
            raise UsageError("optimizer.step() outside the prepared training loop",
                             "call it inside `for batch in train_dataloader`, after accelerator.backward(loss)")
        done = self.plain.optimizer_step()
        if done is not None:
            self.last_loss = done.loss

    def schedule(self, scheduler) -> None:
        """lr_scheduler.step(): once per global step, after its optimizer step (skipped with it when
        fp16 overflowed, as stock's AcceleratedScheduler does)."""
        done = self.plain.finished
        if done is None or self.plain.micro_batches is None or self.scheduled == done.index:
            return
        self.scheduled = done.index
        if done.index not in self.engine.job.precision.skipped_steps:
            scheduler.step()

    def steps_per_epoch(self) -> int:
        sampler = self.engine.job.sampler
        if sampler.dataset_len is None:       # as stock's len() of a DataLoader over a stream without one
            raise TypeError("the training data is a stream without a length: one pass over the loader is the "
                            "whole run, Accelerator(hetrain={'max_steps': N})")
        whole = sampler.dataset_len // sampler.global_batch if sampler.drop_last else \
            math.ceil(sampler.dataset_len / sampler.global_batch)
        return max(1, whole)


class TrainLoader:
    """The prepared training DataLoader: iterate it for this rank's micro-batches of one epoch's
    global steps. len() is a stock rank's batches per epoch (steps per epoch x accumulation), so a
    script's `len(train_dataloader) / gradient_accumulation_steps` still counts optimizer steps."""

    def __init__(self, run: Run, loader):
        self.run = run
        self.loader = loader                 # the user's DataLoader (batch_size, dataset, collate_fn)

    dataset = property(lambda self: self.loader.dataset)
    batch_size = property(lambda self: self.loader.batch_size)

    def __len__(self) -> int:
        return self.run.steps_per_epoch() * self.run.accumulation

    def __iter__(self):
        self.run.started = True
        return self.run.plain.epoch(self.run.steps)


class StepOptimizer:
    """The prepared optimizer: step() is hetrain's agreed step on the last micro-batch, zero_grad()
    is hetrain's own after that step; everything else is the optimizer's."""

    def __init__(self, run: Run, optimizer):
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "optimizer", optimizer)

    def step(self, closure=None):
        if closure is not None:
            raise UsageError("optimizer.step(closure) under hetrain's Accelerator: a step's micro-batches run once",
                             "call optimizer.step() after accelerator.backward(loss)")
        self.run.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: hetrain zeroes the gradients right after its step; zeroing between a rank's
        micro-batches would drop what they accumulated."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for an fp16 overflow (every rank agreed it)."""
        return self.run.engine.job.steps_done - 1 in self.run.engine.job.precision.skipped_steps

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.optimizer, name, value)


class StepScheduler:
    """The prepared LR scheduler: step() once per global step, after hetrain's optimizer step."""

    def __init__(self, run: Run, scheduler):
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "scheduler", scheduler)

    def step(self, *args, **kwargs) -> None:
        if args or kwargs:
            raise UsageError("lr_scheduler.step(...) with arguments under hetrain's Accelerator",
                             "call lr_scheduler.step() once per batch, after optimizer.step()")
        self.run.schedule(self.scheduler)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)
