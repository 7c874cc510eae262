"""The objects of the user's loop: Steps (the run), Step (one global batch), MicroBatch.

    for step in batches:            # Steps: one optimizer step over the whole global batch each
        for mb in step:             # Step: this rank's share, in micro-batches that fit its memory
            with mb:                # MicroBatch: the samples, and the scope hetrain watches
                ...
                ht.backward(loss)
        ht.step()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MicroBatch:
    batch: object              # the collated samples, on this rank's device
    size: int                  # samples in it
    index: int                 # position within this rank's micro-batches of the step
    count: int                 # micro-batches this rank runs in the step
    indices: tuple[int, ...]   # dataset indices
    backward_done: bool = False
    catch_oom: bool = True     # `with mb:` turns an OOM into a recovery (runtime/resilience/oom.py)
    failed: str | None = None  # why this micro-batch ran out of memory, if it did
    desynced: bool = False     # the OOM struck inside the step's gradient sync

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def __iter__(self):
        """`x, y = mb` unpacks the batch."""
        return iter(self.batch)

    def __enter__(self) -> MicroBatch:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """An out-of-memory error inside the block is recovered (smaller micro-batch, redo)."""
        if self.catch_oom and exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
            if self.failed is None:
                self.failed = f"forward: {exc}".splitlines()[0][:200]
            self.backward_done = True
            return True
        return False


@dataclass
class Step:
    """One optimizer step. Iterate it for this rank's micro-batches; after ht.step(), `loss` is the
    mean loss over the whole global batch (all ranks), the same number on every rank."""

    index: int                       # global step number (0-based, counts across resumes)
    epoch: int
    indices: tuple[int, ...]         # this rank's dataset indices in this step
    epochs: tuple[int, ...]          # the epoch of each (a step can straddle two)
    loop: object = field(repr=False)  # stepping.StepLoop
    loss: float | None = None
    samples_per_s: float | None = None
    started: bool = field(default=False, repr=False)

    def __iter__(self):
        return self.loop.micro_batches(self)


class Steps:
    """The run's steps: `for step in batches` until max_steps or the epochs are done."""

    def __init__(self, loop):
        self.loop = loop             # stepping.StepLoop

    def __len__(self) -> int:
        job = self.loop.job
        return job.total_steps - job.steps_done

    def __iter__(self):
        job = self.loop.job
        while job.steps_done < job.total_steps:
            yield self.loop.begin_step()
        self.loop.at_boundary()
