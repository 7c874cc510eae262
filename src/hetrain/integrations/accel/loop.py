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
"""

from __future__ import annotations

import math

from ...errors import UsageError


class Run:
    """The state the loader, optimizer, scheduler and accelerator share: the step in progress."""

    def __init__(self, engine, steps, dataset_len: int, drop_last: bool):
        self.engine = engine
        self.steps = iter(steps)              # hetrain's Steps, over the whole run
        self.global_batch = engine.job.config.global_batch
        self.per_epoch = max(1, dataset_len // self.global_batch if drop_last
                             else math.ceil(dataset_len / self.global_batch))
        self.micro = None                     # this step's micro-batch iterator, while one is in progress
        self.mb = None                        # the micro-batch in the user's hands
        self.stepped = False                  # the current step's optimizer step is done
        self.scheduled = False                # ... and its scheduler step
        self.started = False                  # a step ran (load_state must come before)
        self.last_loss: float | None = None   # the last finished step's loss over the global batch

    @property
    def in_step(self) -> bool:
        return self.micro is not None and not self.stepped

    def begin(self) -> bool:
        """The next global step, or False when the run is over (max_steps / epochs)."""
        step = next(self.steps, None)
        if step is None:
            return False
        self.started, self.stepped, self.scheduled = True, False, False
        self.micro = iter(step)
        return True

    def next_micro(self):
        """This rank's next micro-batch of the step, or None once they are done (every rank's
        agreement then ran)."""
        self.mb = next(self.micro, None)
        return self.mb

    def step(self) -> None:
        """optimizer.step(): on this rank's last micro-batch, finish the step for every rank."""
        if self.mb is None or self.stepped:
            if self.stepped:
                return                  # stock steps once per sync; a second call is a no-op here too
            raise UsageError("optimizer.step() outside the prepared training loop",
                             "call it inside `for batch in train_dataloader`, after accelerator.backward(loss)")
        if not self.mb.last:
            return                      # accumulating: as stock's step while sync_gradients is False
        if not self.mb.backward_done:
            raise UsageError("optimizer.step() before accelerator.backward(loss) on this micro-batch",
                             "call accelerator.backward(loss) first")
        if self.next_micro() is not None:       # runs the step's agreement (every rank is here too)
            raise RuntimeError("hetrain ran a micro-batch past the step's last")   # a bug, not the user's
        self.last_loss = self.engine.step().loss
        self.stepped = True

    def schedule(self, scheduler) -> None:
        """lr_scheduler.step(): once per global step, after its optimizer step (skipped with it
        when fp16 overflowed, as stock's AcceleratedScheduler does)."""
        if not self.stepped or self.scheduled:
            return
        self.scheduled = True
        done = self.engine.job.steps_done - 1
        if done not in self.engine.job.precision.skipped_steps:
            scheduler.step()

    def end_of_step(self) -> None:
        """The loader asks for the next micro-batch after this rank's last one: the step must have
        been stepped (an accumulate/sync_gradients loop steps on the last micro-batch)."""
        if not self.stepped:
            raise UsageError("a step's micro-batches ended without optimizer.step() on the last one",
                             "call optimizer.step() on every batch inside accelerator.accumulate(model), or when "
                             "accelerator.sync_gradients is True (hetrain runs uneven numbers of micro-batches, so "
                             "count steps by sync_gradients, not by batches)")
        self.micro = self.mb = None


class TrainLoader:
    """The prepared training DataLoader: iterate it for this rank's micro-batches of one epoch's
    global steps. len() is a stock rank's batches per epoch (steps per epoch x accumulation), so a
    script's `len(train_dataloader) / gradient_accumulation_steps` still counts optimizer steps."""

    def __init__(self, run: Run, loader, accumulation: int):
        self.run = run
        self.loader = loader                 # the user's DataLoader (batch_size, dataset, collate_fn)
        self.accumulation = accumulation

    dataset = property(lambda self: self.loader.dataset)
    batch_size = property(lambda self: self.loader.batch_size)

    def __len__(self) -> int:
        return self.run.per_epoch * self.accumulation

    def __iter__(self):
        run = self.run
        if run.in_step:
            raise UsageError("the training dataloader was iterated again in the middle of a step",
                             "break out of the loop only after optimizer.step() (when accelerator.sync_gradients)")
        run.micro = run.mb = None
        done_at_start = run.engine.job.steps_done
        while True:
            if run.micro is None:
                if run.started and run.engine.job.steps_done > done_at_start and \
                        run.engine.job.steps_done % run.per_epoch == 0:
                    return                                  # the epoch's last step is done
                if not run.begin():
                    return
            mb = run.next_micro() if not run.stepped else None
            if mb is None:
                run.end_of_step()
                continue
            yield mb.batch


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
