"""The training data through Fabric: the user's DataLoader hands hetrain its dataset, collate_fn,
shuffle and drop_last, and what `fabric.setup_dataloaders` returns yields hetrain's steps.

Fabric's own loop is one batch per rank per optimizer step (`for batch in loader`), the same size
on every rank. Under hetrain ranks run uneven shares, in micro-batches sized to each device's
memory, so ranks run different numbers of forwards in one step: one item of the loader is
therefore one optimizer step, and iterating it gives this rank's micro-batches:

    for step in loader:                  # one optimizer step over the whole global batch
        for mb in step:                  # this rank's share, in micro-batches that fit
            with mb:                     # an OOM here: agreed, micro-batch halved, redone
                fabric.backward(model(**mb.batch).loss)    # weighted: the big-batch gradient
        optimizer.step()                 # hetrain's step: agreement, optimizer step, rebalancing

Every DataLoader setting hetrain cannot honour is refused with the fix, never silently dropped:
the samples of each step are hetrain's global-cursor sampler's (it splits them unevenly by the
plan), and each micro-batch's size is the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ...errors import UsageError


@dataclass(frozen=True)
class TrainingData:
    """What hetrain takes from the training DataLoader."""

    dataset: object
    collate_fn: object
    shuffle: bool        # a RandomSampler (DataLoader(shuffle=True)): as Fabric's own DistributedSampler reads it
    drop_last: bool      # an incomplete last global step is dropped


def training_data(loader: DataLoader) -> TrainingData:
    """The DataLoader's facts, or one UsageError naming the setting hetrain cannot honour."""
    def refuse(what: str, fix: str) -> UsageError:
        return UsageError(f"HetrainStrategy's training DataLoader: {what}", fix)

    if isinstance(loader.dataset, IterableDataset):
        raise refuse(f"an IterableDataset ({type(loader.dataset).__name__}): hetrain picks each step's samples by "
                     "index from one global stream, split unevenly over the ranks",
                     "give a map-style dataset (with __len__ and __getitem__)")
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        raise refuse("a DistributedSampler: it gives every rank an equal part, but hetrain gives each rank its own "
                     "share of every step (by its speed and memory)",
                     "remove the sampler: DataLoader(dataset, shuffle=True) (shuffle=False keeps the order); "
                     "hetrain samples for every rank")
    if loader.batch_size is None and loader.batch_sampler is not None:    # DataLoader(batch_sampler=...)
        raise refuse(f"batch_sampler={type(loader.batch_sampler).__name__}: hetrain forms each rank's "
                     "micro-batches itself, by the plan",
                     "remove batch_sampler=; cap micro-batches with "
                     "HetrainStrategy(memory=Memory(max_micro_batch=N)) if you must")
    if type(sampler) not in (RandomSampler, SequentialSampler):
        raise refuse(f"sampler={type(sampler).__name__}: hetrain's own sampler picks every step's samples "
                     "(one global stream, cut by the plan)",
                     "remove sampler=; use DataLoader(dataset, shuffle=True) or shuffle=False")
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(loader.dataset)):
        raise refuse("a RandomSampler with replacement or num_samples: hetrain visits every sample once an epoch",
                     "use DataLoader(dataset, shuffle=True), and max_steps= or epochs= on HetrainStrategy")
    if loader.batch_size != 1:
        raise refuse(f"batch_size={loader.batch_size}: hetrain splits HetrainStrategy(global_batch=N) into each "
                     "device's share and sizes its micro-batches to its memory (plain Fabric's global batch, "
                     "batch_size x devices, does not apply)",
                     "remove batch_size= from the DataLoader; cap micro-batches with "
                     "HetrainStrategy(memory=Memory(max_micro_batch=N))")
    if loader.num_workers:
        raise refuse(f"num_workers={loader.num_workers}: hetrain loads each micro-batch's samples in this process, "
                     "when the plan calls for them", "remove num_workers=")
    return TrainingData(dataset=loader.dataset, collate_fn=loader.collate_fn,
                        shuffle=isinstance(sampler, RandomSampler), drop_last=loader.drop_last)


class LoaderStep:
    """One optimizer step, as the loader yields it: iterate it for this rank's micro-batches; after
    optimizer.step(), `loss` is the whole global batch's mean loss, the same on every rank.

    A plain object, not hetrain's Step itself: Fabric's loader moves every item it yields to the
    device, and deep-copies a dataclass (Step is one) on the way; the copy would not be the step
    hetrain runs. hetrain puts each micro-batch on the device itself."""

    def __init__(self, step):
        self.step = step                 # runtime.loop.steps.Step

    def __iter__(self):
        return iter(self.step)

    index = property(lambda self: self.step.index, doc="global step number (0-based, counts across resumes)")
    epoch = property(lambda self: self.step.epoch)
    indices = property(lambda self: self.step.indices, doc="this rank's dataset indices in this step")
    loss = property(lambda self: self.step.loss, doc="after optimizer.step(): the global batch's mean loss")
    samples_per_s = property(lambda self: self.step.samples_per_s)

    def __repr__(self) -> str:
        return f"LoaderStep({self.step!r})"


class StepLoader:
    """What HetrainStrategy.process_dataloader gives Fabric to wrap: iterating it runs the job's
    steps (max_steps, or epochs of the dataset: one pass over this loader is the whole run)."""

    def __init__(self, strategy):
        self.strategy = strategy         # its `steps` exist once fabric.setup(model, optimizer) ran

    def _steps(self):
        if self.strategy.steps is None:
            raise UsageError("the training loader was iterated before fabric.setup(model, optimizer)",
                             "call fabric.setup(model, optimizer) after fabric.setup_dataloaders(loader), then "
                             "iterate the loader")
        return self.strategy.steps

    def __iter__(self):
        for step in self._steps():
            yield LoaderStep(step)

    def __len__(self) -> int:
        """The steps still to run."""
        return len(self._steps())
