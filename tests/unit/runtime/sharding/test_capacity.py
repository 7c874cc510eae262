"""Capacity-proportional sharding, without processes: the flat layout and the partition (the
update itself is checked against one device in tests/dist/test_sharding.py)."""

from __future__ import annotations

import pytest
import torch

from hetrain.errors import UsageError
from hetrain.runtime.sharding.capacity import CapacityShardedOptimizer, flatten_params
from hetrain.runtime.memory.device_memory import optimizer_kind


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def test_flatten_keeps_values_and_makes_params_and_grads_views():
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    flat, grads = flatten_params(list(m.parameters()))
    assert flat.numel() == sum(p.numel() for p in m.parameters()) == grads.numel()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    for p in m.parameters():
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == grads.untyped_storage().data_ptr()
    torch.nn.functional.mse_loss(m(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    assert grads.abs().sum() > 0          # autograd accumulated into the flat gradient in place


def test_slices_follow_the_fractions_and_zero_grad_keeps_the_views():
    m = model()
    n = sum(p.numel() for p in m.parameters())
    opt = CapacityShardedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), (0.75, 0.25), rank=1,
                                   world_size=2)
    (sizes,) = opt.slice_sizes()
    assert sum(sizes) == n and abs(sizes[0] - 0.75 * n) <= 1
    assert opt.optim.param_groups[0]["params"][0].numel() == sizes[1]     # this rank's slice only
    assert opt.held_tensors() == []                                        # no state before a step
    ptrs = [p.grad.data_ptr() for p in m.parameters()]
    opt.zero_grad(set_to_none=True)
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
    assert opt.param_groups[0]["lr"] == 1e-3 and optimizer_kind(torch.optim.AdamW(m.parameters())) == "adamw"


def test_refuses_what_slices_would_change():
    m = model()
    with pytest.raises(UsageError, match="per-tensor"):
        CapacityShardedOptimizer(torch.optim.LBFGS(m.parameters()), (0.5, 0.5), rank=0, world_size=2)
    used = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    torch.nn.functional.mse_loss(m(torch.randn(2, 6)), torch.randn(2, 3)).backward()
    used.step()
    with pytest.raises(UsageError, match="fresh optimizer"):
        CapacityShardedOptimizer(used, (0.5, 0.5), rank=0, world_size=2)
