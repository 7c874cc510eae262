"""Every tensor handed to a collective is on the job's device (a CUDA job's NCCL group takes no
CPU tensor). The job declares 'meta' as its device, distinct from the host where host-side state
lives (tests/collective_check.py says why): a tensor made by default, or beside host state, shows."""

from __future__ import annotations

import types

import pytest
import torch
from collective_check import CollectiveReached, fake_world
from torch import nn

from hetrain.runtime.sharding.capacity_full import FullSharding, Segment, Slot, Unit
from hetrain.runtime.sharding.capacity_full_state import save_dicts

ACCEL = torch.device("meta")        # the job's device: not the host


def _sharding(*, rank: int, grads: bool = False) -> tuple[nn.Module, FullSharding]:
    """One 12-element parameter on the job's device, split 6/6 over two ranks (it straddles them)."""
    model = nn.Module()
    weight = torch.zeros(4, 3, device=ACCEL)
    seg = Segment([Slot("w", (), weight.shape, 0)], [weight], [0, 6, 12], rank=rank, group_index=0)
    model.register_parameter("capacity_full_root_shard0", seg.shard)
    if grads:
        seg.shard.grad = torch.zeros_like(seg.shard)
    return model, FullSharding(model, Unit("root", [seg]), [], rank=rank, world_size=2, fractions=(0.5, 0.5))


def test_capacity_full_clip_norm_on_a_rank_without_gradients_is_summed_on_the_job_device():
    _, sharding = _sharding(rank=0)
    with fake_world(ACCEL, stop_after=1) as record, pytest.raises(CollectiveReached):
        sharding.clip_grad_norm(1.0)           # reads the sum's value after its all_reduce
    assert [name for name, _ in record.calls] == ["all_reduce"]
    record.assert_on_device()


def test_capacity_full_save_with_offloaded_state_reduces_on_the_job_device():
    """Host optimizer state (what optimizer offload keeps) of a parameter two ranks share: the
    pieces are summed over the ranks on the job's device, not where the state lives."""
    model, sharding = _sharding(rank=1)
    shard = sharding.shards()[0]
    host_state = {"step": torch.tensor(3.0), "exp_avg": torch.ones(6), "exp_avg_sq": torch.ones(6)}
    local = types.SimpleNamespace(state={shard: host_state}, param_groups=[{"params": [shard], "lr": 0.1}])
    optimizer = types.SimpleNamespace(sharding=sharding, optim=local, param_groups=[{"params": [shard], "lr": 0.1}])
    with fake_world(ACCEL, rank=1) as record:
        save_dicts(model, optimizer)
    assert sorted(len(devices) for _, devices in record.calls) == [1, 1, 1]   # param, exp_avg, exp_avg_sq
    record.assert_on_device()


def test_trainer_store_flos_sums_on_the_job_device():
    from transformers.trainer_callback import TrainerState

    from hetrain.integrations.hf.trainer import Trainer

    trainer = Trainer.__new__(Trainer)        # only what store_flos reads
    trainer.state, trainer.current_flos = TrainerState(), 5.0
    trainer.engine = types.SimpleNamespace(device=ACCEL)
    with fake_world(ACCEL, stop_after=1) as record, pytest.raises(CollectiveReached):
        trainer.store_flos()                 # reads the sum after its all_reduce
    record.assert_on_device()
