"""An Accelerate script's own loop on hetrain's steps: what `prepare` hands back.

    for batch in train_dataloader:              # TrainLoader: this rank's micro-batches, step by step
        with accelerator.accumulate(model):     # hetrain already syncs once per step
            loss = model(**batch).loss
            accelerator.backward(loss)          # weighted by the micro-batch's size
            optimizer.step()                    # StepOptimizer: the agreed global step, on the last one
            lr_scheduler.step()                 # StepScheduler: as stock's, after that step
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

A script's own accumulation (Accelerator() with gradient_accumulation_steps=1, the loss divided by
its count, `if step % 2 == 0: optimizer.step()`): a rank whose last micro-batch of a step went
without optimizer.step() asks to keep the gradient; the ranks agree (one small all-reduce a step)
and the step ends without the optimizer, the next adding to its gradient, as stock's replicas do.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..fabric.loop import NOT_PULLED, PlainLoop

STEP, KEEP = 0, 1       # what a rank's last micro-batch of a step asked: the optimizer step, or to keep the gradient


class AccumulationDisagrees(UsageError):
    """Ranks asked differently whether a step takes its optimizer step: every rank raises it."""

    agreed = True


class AccelLoop(PlainLoop):
    """Fabric's plain loop, and a step whose ranks' last micro-batches went without optimizer.step()
    ends with the gradient kept (the module docstring)."""

    def __init__(self, run):
        super().__init__(run)
        self.asked: int | None = None         # STEP or KEEP, by this rank's latest micro-batch of the step

    def finish_step(self):
        engine = self.strategy.engine
        votes = torch.zeros(2, dtype=torch.int64, device=engine.device)
        if self.asked is not None:
            votes[self.asked] = 1
        self.asked = None
        if engine.world_size > 1:
            dist.all_reduce(votes)                                                  # (collective)
        stepped, kept = (int(v) for v in votes.tolist())
        if stepped and kept:
            raise AccumulationDisagrees(
                f"step {engine.steps_done}: {stepped} rank(s) called optimizer.step() after their last batch of the "
                f"step and {kept} did not: counting batches to accumulate by hand needs one batch a rank a step, "
                "and hetrain cut a rank's share into several", "use Accelerator(gradient_accumulation_steps=N) "
                "with `with accelerator.accumulate(model):` and call optimizer.step() every batch")
        self.finished = engine.step(optimizer_step=not kept)
        return self.finished

    def keep_gradient(self) -> None:
        """This rank's batch went by without optimizer.step(): on its last micro-batch of the step,
        end the step keeping the gradient (every rank agrees in finish_step)."""
        mb = self.mb
        if not self.active or mb is None or self.pulled is not NOT_PULLED:
            return
        try:
            self.check_backward(mb)
        except UsageError:
            self.leave_mid_step()
            raise
        self.asked = KEEP
        self.pulled = self.pull()
        if self.pulled is None:
            self.finish_step()


class Run:
    """The loop's state, shared by the loader, optimizer, scheduler and accelerator. The mechanics
    of a plain loop over hetrain's steps are Fabric's own loop's (fabric/loop.py: one pass an epoch,
    a no-op optimizer.step() until a rank's last micro-batch, an OOM in backward redone, a loop body
    that leaves mid-step settled with the peers, which then raise one LoopStopped); Run is what
    that loop reads of its owner (`engine`, `run_length_given`) plus Accelerate's scheduler rule."""

    def __init__(self, engine, steps, *, run_length_given: bool, accumulation: int, scheduler_steps: int):
        self.engine = engine
        self.steps = steps                    # hetrain's Steps
        self.run_length_given = run_length_given   # hetrain={'max_steps' | 'epochs'}; else a pass is an epoch
        self.accumulation = accumulation
        self.scheduler_steps = scheduler_steps     # scheduler.step()s per global step (stock's rule)
        self.plain = AccelLoop(self)
        self.started = False                  # a pass began (load_state must come before)
        self.restored = False                 # load_state restored the job (skip_first_batches: done already)
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
        self.plain.asked = STEP
        done = self.plain.optimizer_step()
        if done is not None:
            self.last_loss = done.loss

    def schedule(self, scheduler, *, with_optimizer: bool = True) -> None:
        """lr_scheduler.step(): once per global step, after it, as many times as stock's
        AcceleratedScheduler on this many equal processes (scheduler_steps; skipped with the step
        when fp16 overflowed). with_optimizer=False (step_scheduler_with_optimizer=False): stock
        steps it every batch, gradient_accumulation_steps times per global step."""
        done = self.plain.finished
        if done is None or self.plain.micro_batches is None or self.scheduled == done.index:
            return
        self.scheduled = done.index
        if not with_optimizer:
            for _ in range(self.accumulation):
                scheduler.step()
        elif not self.engine.step_skipped(done.index):
            for _ in range(self.scheduler_steps):
                if getattr(scheduler, "total_steps", None) is None or scheduler.last_epoch < scheduler.total_steps:
                    scheduler.step()      # (OneCycleLR past its end raises: stock stops there too)

    def steps_per_epoch(self) -> int:
        sampler = self.engine.sampler
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
        plain = self.run.plain
        batches = plain.epoch(self.run.steps)
        try:
            while True:
                plain.keep_gradient()        # the batch before went without optimizer.step()
                yield next(batches)
        except StopIteration:
            return
        finally:
            batches.close()


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
        return self.run.engine.step_skipped(self.run.engine.steps_done - 1)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.optimizer, name, value)


class StepScheduler:
    """The prepared LR scheduler: step() once per global step, after hetrain's optimizer step."""

    def __init__(self, run: Run, scheduler, *, with_optimizer: bool = True):
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "with_optimizer", with_optimizer)

    def step(self, *args, **kwargs) -> None:
        if args or kwargs:
            raise UsageError("lr_scheduler.step(...) with arguments under hetrain's Accelerator",
                             "call lr_scheduler.step() once per batch, after optimizer.step()")
        self.run.schedule(self.scheduler, with_optimizer=self.with_optimizer)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)
