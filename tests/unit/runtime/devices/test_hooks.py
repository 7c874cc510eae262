"""The device hooks the loop calls: a plain device only keeps time; an emulated one throttles to
its speed (here on the controlled clock, so the figures are exact on any host), counts optimizer
state once it exists, and lets injected faults strike where they are asked to."""

from __future__ import annotations

import pytest
import torch

from hetrain.hardware.cluster import parse_cluster
from hetrain.emulation.device import EmulatedDevice
from hetrain.runtime.devices.faults import FaultInjector, parse_faults
from hetrain.emulation.hooks import EmulatedHooks, make_hooks
from hetrain.runtime.devices.hooks import CudaHooks, DeviceHooks
from hetrain.runtime.loop.steps import MicroBatch

CPU = torch.device("cpu")


def micro(size, index=0, count=1):
    return MicroBatch(batch=None, size=size, index=index, count=count, indices=tuple(range(size)))


def run_micro_batch(hooks, mb, step=0):
    hooks.micro_batch_start(mb, step)
    hooks.before_backward(mb)
    t0 = hooks.clock()
    hooks.after_backward(mb, hooks.clock() - t0)
    hooks.micro_batch_end(mb)


def test_the_kind_of_hooks_follows_the_device():
    faults = FaultInjector((), rank=0, attempt=0)
    assert type(make_hooks(CPU, None, faults)) is DeviceHooks
    assert isinstance(make_hooks(CPU, EmulatedDevice(parse_cluster("t4")[0]), faults), EmulatedHooks)
    cuda = make_hooks(torch.device("cuda", 0), None, faults)     # made without touching CUDA
    assert type(cuda) is CudaHooks and cuda.device_clock.cuda     # events time the GPU


def test_a_plain_device_adds_nothing_but_its_clock():
    hooks = DeviceHooks(CPU)
    hooks.attempt_start()
    run_micro_batch(hooks, micro(4))
    assert 0 <= hooks.busy_s < 0.05 and hooks.attempt_busy_s() == hooks.busy_s and hooks.peak_bytes() == 0.0


@pytest.mark.parametrize("speed", [1.0, 0.5])
def test_an_emulated_micro_batch_lasts_its_samples_on_the_controlled_clock(speed):
    device = EmulatedDevice(parse_cluster(f"rtx3090:{speed}")[0], sample_s=0.01)
    hooks = EmulatedHooks(CPU, device, FaultInjector((), rank=0, attempt=0))
    hooks.attempt_start()
    run_micro_batch(hooks, micro(6))
    assert hooks.attempt_busy_s() == pytest.approx(6 * 0.01 / speed, abs=0.01)


def test_a_slowdown_fault_stretches_the_device_from_its_step():
    device = EmulatedDevice(parse_cluster("a100-80g")[0], sample_s=0.01)
    hooks = EmulatedHooks(CPU, device, FaultInjector(parse_faults("slow:rank=0,step=2,factor=3"), rank=0, attempt=0))
    busy = []
    for step in range(4):
        hooks.step_start(step)
        hooks.attempt_start()
        run_micro_batch(hooks, micro(2), step)
        busy.append(hooks.attempt_busy_s())
    assert busy == pytest.approx([0.02, 0.02, 0.06, 0.06], abs=0.01)


def test_an_injected_forward_oom_strikes_in_the_forward_of_the_micro_batch_asked():
    device = EmulatedDevice(parse_cluster("a100-80g")[0])
    hooks = EmulatedHooks(CPU, device, FaultInjector(parse_faults("oom:rank=0,step=1,micro=1"), rank=0, attempt=0))
    hooks.micro_batch_start(micro(2, 0, 2), 1)
    hooks.before_forward()                                    # micro-batch 0: nothing
    hooks.micro_batch_start(micro(2, 1, 2), 1)
    with pytest.raises(torch.OutOfMemoryError):
        hooks.before_forward()
    hooks.before_forward()                                    # once


def test_optimizer_state_is_counted_once_it_exists():
    device = EmulatedDevice(parse_cluster("a100-80g")[0])
    hooks = EmulatedHooks(CPU, device, FaultInjector((), rank=0, attempt=0))
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    device.meter.set_fixed(model, opt)
    before = device.meter.fixed
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    hooks.after_optimizer(model, opt)
    assert device.meter.fixed == before + 2 * 64 * 65 * 4       # Adam's two moments, fp32
