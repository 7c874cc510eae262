"""The training data through Fabric: the user's DataLoader hands hetrain its dataset, collate_fn,
batch_size (the mean share: fabric/setup.py), shuffle and drop_last; what `fabric.setup_dataloaders`
returns yields, pass by pass, this rank's micro-batches of each global step (fabric/loop.py).

Fabric's own loop is one batch per rank per optimizer step, the same size on every rank. Under
hetrain ranks run uneven shares, in micro-batches sized to each device's memory, so ranks run
different numbers of batches in one step; optimizer.step() steps once they all have.

An IterableDataset is read as hetrain.prepare reads a stream (runtime/loop/stream.py): in its own
order, every rank its share's slice of each global step; without a length it needs
HetrainStrategy(max_steps=N), and one pass over the loader is then the whole run.

Every DataLoader setting hetrain cannot honour is refused with the fix, never silently dropped:
the samples of each step are hetrain's global-cursor sampler's (it splits them unevenly by the
plan), and each micro-batch's size is the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from ...errors import UsageError
from ...runtime.loop.stream import is_stream, stream_length


@dataclass(frozen=True)
class TrainingData:
    """What hetrain takes from the training DataLoader."""

    dataset: object
    collate_fn: object
    batch_size: int      # the mean share of a device (fabric/setup.py: the global batch rule)
    shuffle: bool        # a RandomSampler (DataLoader(shuffle=True)): as Fabric's own DistributedSampler reads it
    drop_last: bool      # an incomplete last global step is dropped


def training_data(loader: DataLoader) -> TrainingData:
    """The DataLoader's facts, or one UsageError naming the setting hetrain cannot honour."""
    def refuse(what: str, fix: str) -> UsageError:
        return UsageError(f"HetrainStrategy's training DataLoader: {what}", fix)

    if loader.num_workers:
        raise refuse(f"num_workers={loader.num_workers}: hetrain forms each rank's micro-batches from its share of "
                     "every step, so the DataLoader's own workers would read batches no rank trains on",
                     f"remove num_workers= and pass HetrainStrategy(num_workers={loader.num_workers}): hetrain's workers "
                     "read each micro-batch")
    if is_stream(loader.dataset):
        # Its DataLoader's sampler is torch's stand-in (_InfiniteConstantSampler): the stream's own
        # order is the order (runtime/loop/stream.py), so only batch_size is read.
        if loader.batch_size is None:
            raise refuse("batch_size=None over an IterableDataset: hetrain batches each rank's micro-batches itself",
                         "leave batch_size at its default, or set it to the mean share of a device")
        return TrainingData(dataset=loader.dataset, collate_fn=loader.collate_fn, batch_size=loader.batch_size,
                            shuffle=False, drop_last=loader.drop_last)
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
    if loader.batch_size is None:
        raise refuse("batch_size=None: hetrain batches each rank's micro-batches itself, by the plan",
                     "leave batch_size at its default, or set it to the mean share of a device (the global batch "
                     "over the devices); cap micro-batches with HetrainStrategy(memory=Memory(max_micro_batch=N))")
    return TrainingData(dataset=loader.dataset, collate_fn=loader.collate_fn, batch_size=loader.batch_size,
                        shuffle=isinstance(sampler, RandomSampler), drop_last=loader.drop_last)


class LoaderStep:
    """One optimizer step of the step form (`for step in fabric.strategy.steps()`): iterate it for
    this rank's micro-batches; after optimizer.step(), `loss` is the whole global batch's mean
    loss, the same on every rank."""

    def __init__(self, step):
        self.step = step                 # runtime.loop.steps.Step

    def __iter__(self):
        for mb in self.step:
            yield mb
            if not mb.backward_done:     # said here in Fabric's words, before hetrain's loop says it in its own
                raise UsageError(f"micro-batch {mb.index + 1} of {mb.count} in step {self.step.index} went by without "
                                 "fabric.backward(loss); if the step was unpacked (`inputs, target = step`), a step "
                                 "is not a batch",
                                 "write `for mb in step: with mb: inputs, target = mb.batch` with one "
                                 "fabric.backward(loss) each, or Fabric's own loop `for batch in loader`")

    index = property(lambda self: self.step.index, doc="global step number (0-based, counts across resumes)")
    epoch = property(lambda self: self.step.epoch)
    indices = property(lambda self: self.step.indices, doc="this rank's dataset indices in this step")
    loss = property(lambda self: self.step.loss, doc="after optimizer.step(): the global batch's mean loss")
    samples_per_s = property(lambda self: self.step.samples_per_s)

    def __repr__(self) -> str:
        return f"LoaderStep({self.step!r})"


class StepLoader:
    """What HetrainStrategy.process_dataloader gives Fabric to wrap. Iterating it is Fabric's own
    loop, one epoch a pass (fabric/loop.py): this rank's micro-batches of each global step."""

    def __init__(self, strategy, data: TrainingData):
        self.strategy = strategy
        # what scripts read off a DataLoader (Fabric's wrapper copies these attributes onto itself)
        self.dataset, self.batch_size, self.drop_last = data.dataset, data.batch_size, data.drop_last

    def __iter__(self):
        return self.strategy.plain.epoch(self.strategy.pieces.ready_steps())

    def __len__(self) -> int:
        """Optimizer steps in an epoch (what stock Fabric's len(loader) counts on each rank): the
        global batches in the dataset, the last one short unless drop_last."""
        data, batch = self.strategy.pieces.data, self.strategy.job_global_batch()
        n = stream_length(data.dataset)
        if n is None:            # as stock's len() of a DataLoader over a stream without one
            raise TypeError(f"the training data is a stream without a length ({type(data.dataset).__name__}): "
                            "one pass over the loader is the whole run, HetrainStrategy(max_steps=N)")
        return n // batch if data.drop_last else -(-n // batch)
