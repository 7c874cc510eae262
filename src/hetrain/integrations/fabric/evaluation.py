"""Evaluation DataLoaders under HetrainStrategy: every loader set up after the training one, with
Fabric's `use_distributed_sampler=True` (its default), is split across the ranks.

Stock Fabric gives each such loader a DistributedSampler: every rank an equal, interleaved part,
padded by repeating samples to the same length. Scripts then sum a metric over their part and
all_gather it (`fabric.all_gather(test_loss).sum() / len(test_loader.dataset)`), or let torchmetrics
sync its state. Unsplit, every rank evaluates the whole set and such a sum counts it once per rank.

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
"""

from __future__ import annotations

import itertools

import torch
from lightning.fabric.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from ...errors import UsageError
from ...runtime.loop.stream import is_stream
from ..evaluation import batch_ranges


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
