"""The weighting identity of runtime/loop/reduce.py, checked in one process on explicit numbers."""

from __future__ import annotations

import pytest
import torch

from hetrain.runtime.loop import reduce


def test_weighted_average_over_ranks_equals_big_batch_gradient():
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    x = torch.randn(37, 5)
    sizes = [[3, 4, 5], [25]]           # rank 0: three micro-batches, rank 1: one
    world, total = len(sizes), sum(map(sum, sizes))
    (x @ w).square().mean().backward()
    big = w.grad.clone()

    per_rank, start = [], 0
    for micro in sizes:
        w.grad = None
        for n in micro:
            loss = (x[start:start + n] @ w).square().mean()
            (loss * reduce.loss_factor(units=n, world_size=world, global_batch=total)).backward()
            start += n
        per_rank.append(w.grad.clone())
    ddp_average = sum(per_rank) / world
    assert torch.allclose(ddp_average, big, atol=1e-6)


def test_token_correction():
    assert reduce.token_correction(global_batch=8, total_units=32) == 0.25
    with pytest.raises(ValueError, match="tokens"):
        reduce.token_correction(global_batch=8, total_units=0)
