"""Micro-batches read by worker processes (Config.num_workers, the Trainer's dataloader_num_workers).

The samples of a step are known only when the step begins (the global cursor cut by the shares of
the Plan in force, runtime/loop/sampler.py), and an OOM may cut them into smaller micro-batches for
a redo. So the reader is a torch DataLoader whose batch sampler is this attempt's list of
micro-batches: each attempt is one pass over the loader, its workers kept across passes
(persistent_workers), so a step pays no worker start-up. A pass left early (an OOM mid-attempt)
is dropped by the next: torch's loader discards a reset pass's outstanding batches. Each
micro-batch is collated in a worker, as a DataLoader's batch is, and moved to the rank's device here.

Not for a stream (runtime/loop/stream.py): its samples arrive in this process, step by step, and a
forked worker would not see them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from ..user_objects import to_device


class MicroBatchReader:
    """Collated micro-batches of one attempt, in order, read by `num_workers` processes."""

    def __init__(self, dataset, collate: Callable, *, num_workers: int, device: torch.device):
        self._chunks: list[list[int]] = []
        self.device = device
        self.loader = DataLoader(dataset, batch_sampler=self, collate_fn=collate, num_workers=num_workers,
                                 persistent_workers=True, pin_memory=device.type == "cuda")

    # The batch-sampler protocol: the loader asks for this pass's micro-batches' indices.
    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)

    def read(self, chunks: Sequence[Sequence[int]]) -> Iterator[object]:
        """Each chunk's samples, collated, on the device: one pass of the loader."""
        self._chunks = [list(c) for c in chunks]
        for batch in self.loader:
            yield to_device(batch, self.device)
