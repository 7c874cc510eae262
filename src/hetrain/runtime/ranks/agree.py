"""Agreement: every decision that changes what ranks do next is made from values all ranks see.

`exchange` is one small all-reduce: each rank writes its values into its own row of a W×K table
and the sum gives every rank every row (an all-gather that works on gloo and NCCL alike). Ranks
then take the same decision from the same table, so none can go its own way and leave a peer
waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


# The values every rank sends at the end of each step (runtime/loop/stepping.py), in this order.
# "warnings": how many warnings the rank holds for rank 0 to print (runtime/ranks/log.py); "stop":
# the stop signal the rank received, or 0 (runtime/resilience/preempt.py). "sync_s" and "peak_bytes"
# (the step's gradient-sync wait and memory peak) are for the metrics (runtime/loop/metrics.py) only.
STEP_KEYS = ("units", "loss_sum", "compute_s", "busy_s", "fixed_s", "micro", "desync", "fatal", "version",
             "warnings", "stop", "sync_s", "peak_bytes")


class Table:
    """Every rank's values for the same keys, as a W×K table of floats."""

    def __init__(self, keys: Sequence[str], rows: torch.Tensor):
        self.keys = tuple(keys)
        self._rows = rows.tolist()

    def column(self, key: str) -> list[float]:
        i = self.keys.index(key)
        return [row[i] for row in self._rows]

    def sum(self, key: str) -> float:
        return sum(self.column(key))

    def any(self, key: str) -> bool:
        return any(v != 0 for v in self.column(key))

    def row(self, rank: int) -> dict[str, float]:
        return dict(zip(self.keys, self._rows[rank]))


def exchange(values: dict[str, float], *, rank: int, world_size: int, device: torch.device) -> Table:
    """All ranks call this with the same keys, in the same order; all get every rank's values."""
    keys = list(values)
    table = torch.zeros(world_size, len(keys), dtype=torch.float64, device=device)
    table[rank] = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(table)
    return Table(keys, table.cpu())
