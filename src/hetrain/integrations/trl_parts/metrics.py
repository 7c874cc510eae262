"""TRL's logged metrics under hetrain's loop: gathered nowhere per micro-batch, agreed at each log.

TRL's compute_loss gathers its metrics (entropy, token accuracy, rewards, token counts) across the
processes with `accelerator.gather` / `gather_for_metrics` on every micro-batch. That is a
collective, fine when every rank runs the same number of micro-batches; under hetrain ranks run
uneven shares in different numbers of micro-batches, so a rank with more would wait for a peer that
has none left (a two-rank SFT run with packing hung there). So inside compute_loss the gathers are
rank-local (`rank_local_gathers`), and at each log every rank's lists are agreed in one all-reduce
(`agree`): the logged value is the mean over every micro-batch of every rank, and `num_tokens`, a
running total, the sum of the ranks' totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist

TOTALS = ("num_tokens",)      # running totals (one value a rank): summed over ranks, not averaged
GATHERS = ("gather", "gather_for_metrics")


def local(data, use_gather_object: bool = False):
    """What accelerate's gather returns on one process: a 0-d tensor as a 1-element one, tensors
    as they are, containers item by item."""
    if isinstance(data, torch.Tensor):
        return data[None] if data.ndim == 0 else data
    if isinstance(data, (list, tuple)):
        return type(data)(local(d) for d in data)
    if isinstance(data, Mapping):
        return type(data)({k: local(v) for k, v in data.items()})
    return data


@contextmanager
def rank_local_gathers(accelerator):
    """accelerator.gather and gather_for_metrics as this rank's own values while inside (instance
    attributes over the class's methods, removed on the way out; a nested entry leaves them)."""
    if accelerator is None or accelerator.num_processes == 1 or "gather" in vars(accelerator):
        yield
        return
    for name in GATHERS:
        setattr(accelerator, name, local)
    try:
        yield
    finally:
        for name in GATHERS:
            delattr(accelerator, name)


def agree(metrics: dict, device: torch.device) -> None:
    """Every rank's metric lists -> one value each, the same on every rank (a collective: each rank
    calls it at the same log). In place: each list becomes [value]."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(metrics))     # a rank may lack a key (no micro-batch logged it)
    keys = sorted(set().union(*names))
    sums = torch.tensor([[float(sum(metrics.get(k, ()))), float(len(metrics.get(k, ())))] for k in keys],
                        dtype=torch.float64, device=device).reshape(-1, 2)
    dist.all_reduce(sums)
    for k, (total, count) in zip(keys, sums.tolist()):
        if count:
            metrics[k] = [total if k in TOTALS else total / count]
