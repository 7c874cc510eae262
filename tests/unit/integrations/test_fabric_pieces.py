"""The pieces of Fabric's own loop under HetrainStrategy that need no job: how many steps a pass
over the loader runs (one epoch of hetrain's sampler, as stock Fabric counts them), the global
batch rule (the DataLoader's batch_size is the mean share), and the optimizer seen through hetrain
(zero_grad waits inside a step; LR schedulers accept it)."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch

from hetrain.errors import UsageError
from hetrain.runtime.loop.sampler import GlobalCursorSampler

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason='needs pip install "hetrain[lightning]"')


def passes(n, batch, *, drop_last, count=4):
    """Steps of each of `count` passes, driving a real sampler as the loop does."""
    from hetrain.integrations.fabric.loop import PlainLoop

    sampler = GlobalCursorSampler(n, batch, shuffle=False, drop_last=drop_last)
    job, out = SimpleNamespace(sampler=sampler), []
    for _ in range(count):
        steps = PlainLoop(None).steps_in_pass(job)
        seen = [sampler.next_step() for _ in range(steps)]
        out.append((steps, {s.epoch for s in seen}))
    return out


@pytest.mark.parametrize("n", [256, 100, 64, 65, 127])
def test_a_pass_is_one_epoch_of_steps_as_stock_fabric_counts_them(n):
    # carry (drop_last=False): as many steps as stock Fabric's epoch, ceil(n / global batch), the
    # last one topped up from the next epoch's start; every pass starts in a new epoch
    for e, (steps, epochs) in enumerate(passes(n, 64, drop_last=False)):
        assert steps == math.ceil(n / 64) or (n % 64 and steps == math.ceil(n / 64) - 1)
        assert min(epochs) == e
    total = sum(steps for steps, _ in passes(n, 64, drop_last=False, count=8))
    assert abs(total - 8 * n / 64) < 1           # every sample once an epoch: 8 epochs' worth of steps
    # drop: stock's drop_last, n // global batch whole steps each epoch
    assert [s for s, _ in passes(n, 64, drop_last=True)] == [n // 64] * 4


def test_the_global_batch_is_batch_size_times_devices_unless_named():
    from hetrain.integrations.fabric.data import TrainingData, global_batch

    def data(b):
        return TrainingData(dataset=None, collate_fn=None, batch_size=b, shuffle=True, drop_last=False)

    assert global_batch(None, data(32), 2) == 64
    assert global_batch(64, data(32), 2) == 64
    assert global_batch(64, data(1), 2) == 64          # the DataLoader's default says nothing
    with pytest.raises(UsageError) as e:
        global_batch(96, data(32), 2)
    assert "batch_size=32 on 2 devices is 64" in e.value.what and "DataLoader(batch_size=48)" in e.value.fix


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")     # no optimizer step here
def test_zero_grad_waits_inside_a_step_and_schedulers_take_the_optimizer():
    from hetrain.integrations.fabric.data import FabricOptimizer, FabricScheduler

    p = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([p], lr=0.5)
    strategy = SimpleNamespace(engine=None, inside=True, in_step=lambda: strategy.inside)
    opt = FabricOptimizer(inner, strategy)
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert p.grad is not None                   # inside a step: the micro-batches' gradient stays
    strategy.inside = False
    opt.zero_grad()
    assert p.grad is None
    assert opt.param_groups is inner.param_groups and opt.state_dict() == inner.state_dict()
    scheduler = FabricScheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)), strategy)
    strategy.inside = True
    scheduler.step()                             # a batch that did not end the step
    assert inner.param_groups[0]["lr"] == 0.5
    strategy.inside = False
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.25 and scheduler.get_last_lr() == [0.25]


def test_fabrics_accelerator_must_be_the_device_type_the_ranks_run_on(monkeypatch):
    from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator

    from hetrain.emulation import Emulation
    from hetrain.integrations.fabric.strategy import HetrainStrategy, check_world
    from hetrain.runtime.config import LAUNCH_ENV, Config
    from hetrain.runtime.engine import rank_device_type

    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)       # a host with a GPU
    assert rank_device_type(Config(global_batch=4)) == "cuda"
    strategy = HetrainStrategy(global_batch=4, emulation=Emulation(cluster="a100-80g,rtx3090"))
    assert strategy.ranks_device_type() == "cpu"         # its ranks are CPU processes, GPU or not
    strategy.accelerator = CUDAAccelerator()
    with pytest.raises(UsageError) as e:                  # refused before joining: no job left behind
        check_world(strategy)
    assert "CUDAAccelerator" in e.value.what and "run on the CPU" in e.value.what
    assert e.value.fix == "pass Fabric(accelerator='cpu')"
    strategy.accelerator, strategy.parallel_devices = CPUAccelerator(), [torch.device("cpu")]
    check_world(strategy)                                 # Fabric's CPU default: one device, one node
