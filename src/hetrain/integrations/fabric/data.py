"""What HetrainStrategy's setup calls take and return: the training DataLoader as hetrain's data
and the loader of steps Fabric wraps, the evaluation DataLoaders split by the plan, the setup order
with the global batch rule, and the model and optimizer Fabric wraps.

The training data. The user's DataLoader hands hetrain its dataset, collate_fn, batch_size (the
mean share: the global batch below), shuffle and drop_last; what `fabric.setup_dataloaders` returns
yields, pass by pass, this rank's micro-batches of each global step (fabric/loop.py). Fabric's own
loop is one batch per rank per optimizer step, the same size on every rank. Under hetrain ranks run
uneven shares, in micro-batches sized to each device's memory, so ranks run different numbers of
batches in one step; optimizer.step() steps once they all have.

An IterableDataset is read as hetrain.prepare reads a stream (runtime/loop/stream.py): in its own
order, every rank its share's slice of each global step; without a length it needs
HetrainStrategy(max_steps=N), and one pass over the loader is then the whole run.

Every DataLoader setting hetrain cannot honour is refused with the fix, never silently dropped:
the samples of each step are hetrain's global-cursor sampler's (it splits them unevenly by the
plan), and each micro-batch's size is the plan's.

Evaluation DataLoaders. Every loader set up after the training one, with Fabric's
`use_distributed_sampler=True` (its default), is split across the ranks. Stock Fabric gives each
such loader a DistributedSampler: every rank an equal, interleaved part, padded by repeating
samples to the same length. Scripts then sum a metric over their part and all_gather it
(`fabric.all_gather(test_loss).sum() / len(test_loader.dataset)`), or let torchmetrics sync its
state. Unsplit, every rank evaluates the whole set and such a sum counts it once per rank.

Here each rank takes a contiguous run of the batches one process would make (same batch_size,
same order), sized by its share of the plan (integrations/evaluation.py; an even split before the
plan exists), so the slow device evaluates less. Nothing is padded: every sample is evaluated
exactly once, so sums over the ranks equal one process's, where stock's padding counts up to
W-1 samples twice. Ranks may run different numbers of batches, so a collective inside the
evaluation loop is refused (HetrainStrategy.check_collective); gather after it, as the examples
do. A shuffled evaluation loader is shuffled by the job's seed, the same permutation on every
rank (a fresh one each pass). Streams (IterableDataset) and a DistributedSampler of the user's
own are left as they are, as stock does; `use_distributed_sampler=False` leaves the loader whole
on every rank.

The setup order. fabric.setup / setup_module / setup_optimizers / setup_dataloaders, in any order:
each hands its piece over, and hetrain.prepare runs once it has the model, the optimizer and the
training data (it measures the model on the data to plan every device's share), at the call that
brought the last of them (a collective: every rank makes the same calls in the same order).

The global batch. Stock Fabric on W equal devices steps over `batch_size x W` samples, the
DataLoader's batch_size on every rank. hetrain keeps that number (so a learning rate means what it
meant) and splits it unevenly: the DataLoader's batch_size is read as the MEAN share of a device,
as the Trainer integration reads per_device_train_batch_size. HetrainStrategy(global_batch=N)
names it directly and must then agree with batch_size x W, unless the DataLoader kept its default
batch_size of 1 (nothing said).

The wrappers: what fabric.setup / setup_module / setup_optimizers return (Fabric then wraps them in
its own _FabricModule and _FabricOptimizer). They exist because Fabric lets the model, the
optimizer and the data be set up in any order, and hetrain can only wrap the model (DDP, the OOM
guard, a sharding that may replace the optimizer) once it has all three: it measures the model on
the data to plan the shares. Until then these stand for the user's own objects; once hetrain has
prepared them, for hetrain's.

The optimizer's zero_grad (and the step of a scheduler given to fabric.setup) is also where
Fabric's own loop (`optimizer.zero_grad()` every batch) meets hetrain's accumulation: a batch of
that loop is one micro-batch of this rank's share, and the gradient of the global step builds up
over all of them. zero_grad inside a step is therefore a no-op (hetrain zeroes the gradients itself
after every optimizer step and before a redo); outside one it is the optimizer's. The same for
scheduler.step(): stepped every batch, as a stock loop does, it would move the learning rate once
per micro-batch; it acts once per global step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from lightning.fabric.utilities.data import _update_dataloader
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from ...errors import UsageError
from ...runtime.loop.stream import is_stream, stream_length
from ..evaluation import batch_ranges


@dataclass(frozen=True)
class TrainingData:
    """What hetrain takes from the training DataLoader."""

    dataset: object
    collate_fn: object
    batch_size: int      # the mean share of a device (the global batch rule: global_batch below)
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


# -- evaluation DataLoaders: each rank its part of the batches ---------------------------------------
def evaluation_loader(strategy, loader: DataLoader) -> DataLoader:
    """This rank's part of an evaluation DataLoader (module docstring), rebuilt as Fabric rebuilds
    one for its DistributedSampler; the loader as it is where stock would not split it."""
    if strategy.world_size < 2 or is_stream(loader.dataset) or isinstance(loader.sampler, DistributedSampler):
        return loader
    return _update_dataloader(loader, RankPart(strategy, loader.sampler, batch_size=loader.batch_size or 1,
                                               drop_last=loader.drop_last if loader.batch_size else False))


class RankPart(Sampler):
    """The positions of this rank's run of batches, in the loader's own order. Read at every pass
    (and len()), so a plan that changed since (a rebalance) splits the next pass."""

    def __init__(self, strategy, base: Sampler, *, batch_size: int, drop_last: bool):
        self.strategy, self.base, self.batch_size, self.drop_last = strategy, base, batch_size, drop_last
        self.passes = 0

    def part(self) -> range:
        n, b = len(self.base), self.batch_size
        batches = n // b if self.drop_last else -(-n // b)
        mine = batch_ranges(batches, self.strategy.evaluation_shares())[self.strategy.global_rank]
        return range(mine.start * b, min(mine.stop * b, n))

    def __len__(self) -> int:
        return len(self.part())

    def __iter__(self):
        part = self.part()
        with self.strategy.evaluation_pass():
            yield from itertools.islice(self.order(), part.start, part.stop)

    def order(self):
        base = self.base
        if type(base) is RandomSampler and not base.replacement and base.num_samples == len(base.data_source):
            # torch's RandomSampler draws from each process's own RNG: the ranks would cut
            # different permutations. One seeded by the job, the same on every rank.
            g = torch.Generator().manual_seed(self.strategy.joined().config.seed * 1000 + self.passes)
            self.passes += 1
            return iter(torch.randperm(len(base), generator=g).tolist())
        return iter(base)


def refuse_sharded(model) -> None:
    """A model sharded by FSDP2 gathers its parameters in every forward: every rank must run the
    same forwards, which a split evaluation does not."""
    if model is not None and any(hasattr(p, "full_tensor") for p in model.parameters()):
        raise UsageError("an evaluation DataLoader split across the ranks under hetrain's FSDP2 sharding: each rank "
                         "runs its own part of the batches, and a sharded model needs every rank in every forward",
                         "set the loader up with fabric.setup_dataloaders(loader, use_distributed_sampler=False) "
                         "(every rank evaluates all of it), or HetrainStrategy(sharding='zero1' or 'none')")


# -- the setup calls, in any order; the global batch -------------------------------------------------
def global_batch(given: int | None, data: TrainingData, world_size: int) -> int:
    """The job's global batch from HetrainStrategy(global_batch=) and the DataLoader's batch_size."""
    implied = data.batch_size * world_size
    if given is None:
        return implied
    if data.batch_size != 1 and given != implied:
        raise UsageError(f"HetrainStrategy(global_batch={given}) but the training DataLoader's batch_size="
                         f"{data.batch_size} on {world_size} devices is {implied} samples per step (batch_size is "
                         "read as the mean share of a device)",
                         f"drop global_batch= from HetrainStrategy, or use DataLoader(batch_size={given // world_size})"
                         if given % world_size == 0 else
                         "drop global_batch= from HetrainStrategy, or drop batch_size= from the DataLoader")
    return given


class Pieces:
    """What the setup calls have handed over, and what hetrain.prepare made of them."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.module = self.optimizer = self.scheduler = None    # the user's own
        self.data: TrainingData | None = None
        self.steps = None                  # hetrain's Steps, once prepared

    def take_both(self, module, optimizer, scheduler=None):
        """fabric.setup(model, optimizer[, scheduler=]): both in before prepare may run. Returns
        what Fabric wraps: the model, the optimizer, the scheduler (None when none was given)."""
        self.check_new(module=module, optimizer=optimizer)
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.prepare_when_ready()
        return (FabricModel(module, self.strategy), FabricOptimizer(optimizer, self.strategy),
                FabricScheduler(scheduler, self.strategy) if scheduler is not None else None)

    def take_module(self, module) -> FabricModel:
        self.check_new(module=module)
        self.module = module
        self.prepare_when_ready()
        return FabricModel(module, self.strategy)

    def take_optimizer(self, optimizer) -> FabricOptimizer:
        self.check_new(optimizer=optimizer)
        self.optimizer = optimizer
        self.prepare_when_ready()
        return FabricOptimizer(optimizer, self.strategy)

    def check_new(self, *, module=None, optimizer=None) -> None:
        if module is not None and self.module is not None:
            raise UsageError("a second model set up under HetrainStrategy (fabric.setup or setup_module called twice)",
                             "set up one model and one optimizer per job")
        if optimizer is not None and self.optimizer is not None:
            raise UsageError("a second optimizer set up under HetrainStrategy", "set up exactly one optimizer")

    def take_data(self, data: TrainingData) -> None:
        if stream_length(data.dataset) is None and self.strategy.joined().config.max_steps is None:
            raise UsageError(f"HetrainStrategy's training DataLoader reads an IterableDataset without a length "
                             f"({type(data.dataset).__name__}): its passes' steps cannot be counted",
                             "pass HetrainStrategy(max_steps=N) (or give the dataset a __len__)")
        global_batch(self.strategy.given_global_batch, data, self.strategy.joined().world_size)   # refused here
        self.data = data
        self.prepare_when_ready()

    def missing(self) -> list[str]:
        """The setup calls hetrain still waits for."""
        calls = [] if self.data is not None else ["fabric.setup_dataloaders(train_loader)"]
        if self.module is None and self.optimizer is None:
            return [*calls, "fabric.setup(model, optimizer)"]
        return calls + (["fabric.setup_module(model)"] if self.module is None else []) + (
            ["fabric.setup_optimizers(optimizer)"] if self.optimizer is None else [])

    def ready_steps(self):
        """hetrain's Steps, or one UsageError naming the setup call still missing."""
        if self.steps is None:
            raise UsageError("the training loader was iterated before " + " and ".join(self.missing()),
                             "set up the model, its optimizer and the training DataLoader first, in any order")
        return self.steps

    def prepare_when_ready(self) -> None:
        if self.steps is not None or self.missing():
            return
        strategy, module, optimizer = self.strategy, self.module, self.optimizer
        engine = strategy.joined()
        # The DataLoader's word for these (as for Fabric's own sampler), and the global batch rule above.
        engine.configure(shuffle=self.data.shuffle, drop_last=self.data.drop_last,
                         global_batch=global_batch(strategy.given_global_batch, self.data, engine.world_size))
        model, prepared, self.steps = engine.prepare(module, optimizer, self.data.dataset,
                                                     collate_fn=self.data.collate_fn, forward=strategy.forward,
                                                     parallel=strategy.layout)                  # (collective)
        if self.scheduler is None:
            return
        if getattr(self.scheduler, "optimizer", None) is not prepared:
            raise UsageError("the LR scheduler's optimizer is not the one hetrain trains with (its sharding replaced "
                             "the optimizer)",
                             "build the scheduler on the optimizer fabric.setup(model, optimizer) returns, after "
                             "fabric.setup_dataloaders, then fabric.strategy.engine.register_state('lr_scheduler', "
                             "scheduler)")
        engine.register_state("lr_scheduler", self.scheduler)   # checkpointed with the job, restored on resume


# -- what fabric.setup returns -----------------------------------------------------------------------
class FabricModel(nn.Module):
    """The user's module until hetrain prepared it, then hetrain's model (DDP with uneven shares,
    its device hooks' memory meter). Parameters, train()/eval() and state_dict are the
    user's module's either way (Fabric's wrapper reads state_dict from the user's module)."""

    def __init__(self, module: nn.Module, strategy):
        super().__init__()
        self.module = module
        object.__setattr__(self, "hetrain_strategy", strategy)    # not a submodule

    def forward(self, *args, **kwargs):
        strategy = self.hetrain_strategy
        prepared = strategy.engine.model if strategy.engine is not None else None
        if prepared is None:
            return self.module(*args, **kwargs)
        if not strategy.in_step():
            # Evaluation, between steps: ranks run different numbers of batches there
            # (the evaluation section above), and DDP's forward may run collectives of its own (buffers
            # broadcast, its buckets' rebuild). The user's module holds the same parameters.
            return prepared.module(*args, **kwargs)
        strategy.plain.forwards += 1
        try:
            return prepared(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            if not strategy.plain.settles():
                raise
            failed = f"forward: {e}".splitlines()[0][:200]
        # Out of the except block: its traceback no longer holds the failed forward's graph.
        strategy.plain.forward_oom(failed)   # Fabric's own loop: settled with the peers, one error on all
        raise torch.OutOfMemoryError(failed)


def _target(opt) -> torch.optim.Optimizer:
    """The optimizer an optimizer step and zero_grad act on: hetrain's once it prepared (sharding
    may replace the user's), the user's before. `opt` is this wrapper, or Fabric's around it (whose
    unknown attributes Fabric forwards here)."""
    engine = opt.hetrain_strategy.engine
    prepared = engine.optimizer if engine is not None else None
    return prepared if prepared is not None else opt.hetrain_optimizer


class FabricOptimizer(torch.optim.Optimizer):
    """The user's optimizer, seen through hetrain. A subclass of Optimizer so that LR schedulers
    and isinstance checks accept it (Fabric builds its own wrapper's class from this one's); it
    holds no state itself: every attribute is the target optimizer's. Methods here may run with
    `self` being Fabric's wrapper, so they read only attributes Fabric forwards (hetrain_*)."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy):   # no Optimizer.__init__: no state here
        self.hetrain_optimizer = optimizer
        self.hetrain_strategy = strategy

    def __getattr__(self, name: str):
        if name.startswith("hetrain_"):      # not set yet (unpickling, say): not the target's to answer
            raise AttributeError(name)
        return getattr(_target(self), name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op inside a global step (the micro-batches' gradients accumulate); else the
        optimizer's."""
        if self.hetrain_strategy.in_step():
            return
        _target(self).zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """Reached only by calling this object's step directly (Fabric's wrapper calls the
        strategy): the same as optimizer.step() through Fabric."""
        return self.hetrain_strategy.optimizer_step(self) if closure is None else \
            self.hetrain_strategy.optimizer_step(self, closure=closure)

    def state_dict(self):
        return _target(self).state_dict()

    def load_state_dict(self, state_dict) -> None:
        _target(self).load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        _target(self).add_param_group(param_group)

    def __repr__(self) -> str:
        return f"FabricOptimizer({_target(self)!r})"


class FabricScheduler:
    """The LR scheduler given to fabric.setup(model, optimizer, scheduler=...): step() is a no-op
    inside a global step, so a loop that steps it every batch steps it once per optimizer step.
    Everything else is the scheduler's (hetrain checkpoints the scheduler itself)."""

    def __init__(self, scheduler, strategy):
        self.hetrain_scheduler = scheduler
        self.hetrain_strategy = strategy

    def step(self, *args, **kwargs) -> None:
        if not self.hetrain_strategy.in_step():
            self.hetrain_scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("hetrain_"):
            raise AttributeError(name)
        return getattr(self.hetrain_scheduler, name)

    def __repr__(self) -> str:
        return f"FabricScheduler({self.hetrain_scheduler!r})"
