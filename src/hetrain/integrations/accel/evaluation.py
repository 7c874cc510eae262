"""Evaluation DataLoaders and gather_for_metrics over uneven shares.

Stock Accelerate gives every rank an equal slice of each evaluation batch and gather_for_metrics
concatenates them, dropping the samples it repeated to even out the last batch. Under hetrain the
ranks are of different speeds, so each evaluation batch of `batch_size x ranks` samples is cut in
contiguous slices in proportion to the ranks' training shares. Every rank runs the same number of
batches (each gather is a collective), a faster rank larger ones; gather_for_metrics puts the
slices back in rank order, so the result holds each sample exactly once, in the dataset's order.
A rank whose slice of a short last batch would be empty computes one repeated sample, dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..evaluation import split


class EvalLoader:
    """A prepared evaluation DataLoader: this rank's contiguous slice of each batch."""

    def __init__(self, accelerator, loader):
        self.accelerator = accelerator
        self.loader = loader
        self.padded = 0                # repeated samples in this rank's current batch (gather drops them)
        self.size = 0                  # samples in this rank's current batch

    dataset = property(lambda self: self.loader.dataset)
    batch_size = property(lambda self: self.loader.batch_size)

    def __len__(self) -> int:
        return math.ceil(len(self.loader.dataset) / (self.loader.batch_size * self.accelerator.num_processes))

    def __iter__(self):
        acc = self.accelerator
        acc.current_eval = self
        rank, world = acc.process_index, acc.num_processes
        data, collate = self.loader.dataset, self.loader.collate_fn
        per = self.loader.batch_size * world
        weights = acc.shares()
        try:
            for start in range(0, len(data), per):
                end = min(start + per, len(data))
                sizes = split(end - start, weights)
                first = start + sum(sizes[:rank])
                indices = list(range(first, first + sizes[rank]))
                self.padded = 0 if indices else 1
                indices = indices or [end - 1]
                self.size = len(indices)
                yield acc.to_device(collate([data[i] for i in indices]))
        finally:
            acc.current_eval, self.padded, self.size = None, 0, 0


def all_tensors(data) -> bool:
    """Tensors, or dicts/lists/tuples of them (else gather_for_metrics gathers objects, as stock does)."""
    if isinstance(data, Mapping):
        return all(all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(all_tensors(v) for v in data)
    return isinstance(data, torch.Tensor)


def gather(data, *, padded: int, size: int, device):
    """Every rank's `data` concatenated along dim 0 in rank order (a collective); a rank's
    `padded` repeated samples dropped from a tensor whose first dimension is its batch (`size`)."""
    if isinstance(data, Mapping):
        return type(data)({k: gather(v, padded=padded, size=size, device=device) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(gather(v, padded=padded, size=size, device=device) for v in data)
    if not isinstance(data, torch.Tensor):
        raise UsageError(f"gather_for_metrics of a {type(data).__name__}",
                         "gather tensors (or dicts/lists of them), or pass use_gather_object=True")
    x = data[None] if data.ndim == 0 else data
    if padded and x.shape[0] == size:
        x = x[:size - padded]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return x
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor([x.shape[0]], dtype=torch.long, device=device))
    longest = max(int(n) for n in lengths)
    full = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=device)
    full[:x.shape[0]] = x
    parts = [torch.empty_like(full, device=device) for _ in lengths]
    dist.all_gather(parts, full)
    return torch.cat([p[:int(n)] for p, n in zip(parts, lengths)])


def gather_objects(items: list, *, padded: int) -> list:
    """use_gather_object=True: every rank's list, concatenated in rank order."""
    items = list(items)[:len(items) - padded] if padded else list(items)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return items
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, items)
    return [x for part in every for x in part]
