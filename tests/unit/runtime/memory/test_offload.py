"""The host-stepping optimizer on its own (one process): the same float64 updates as the user's
optimizer on the device, LR schedules followed, its state_dict loadable into a plain optimizer, the
state counted on the host and not by the emulated meter; the host's room read; the config's word."""

from __future__ import annotations

import copy

import pytest
import torch

from nets import BlockNet
from hetrain import Memory
from hetrain.errors import UsageError
from hetrain.emulation.device import MemoryMeter
from hetrain.runtime.memory import offload
from hetrain.runtime.memory.offload import HostOptimizer


def net():
    torch.manual_seed(0)
    return BlockNet(8, 16, 3).double()


def train(model, opt, steps=4, scheduler=None):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
                                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)])
def test_steps_on_the_host_as_the_optimizer_on_the_device(make):
    ref, off = net(), net()
    plain = make(ref.parameters())
    host = HostOptimizer(make(off.parameters()))
    train(ref, plain, scheduler=torch.optim.lr_scheduler.StepLR(plain, 1, gamma=0.5))
    train(off, host, scheduler=torch.optim.lr_scheduler.StepLR(host, 1, gamma=0.5))
    assert all(torch.equal(a, b) for a, b in zip(params(ref), params(off)))
    assert host.param_groups[0]["lr"] == plain.param_groups[0]["lr"]
    # the state lives on the host copies; looked up by the device's parameters
    p = next(off.parameters())
    assert host.state[p] is host.host.state[host.host_of[p]] and len(host.state) == len(plain.state)
    assert not any(t.data_ptr() == q.data_ptr() for t in host.host_tensors() for q in off.parameters())


def test_state_dict_is_the_plain_optimizers_and_loads_back():
    ref, off = net(), net()
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    host = HostOptimizer(torch.optim.AdamW(off.parameters(), lr=0.01))
    train(ref, plain)
    train(off, host)
    sd = host.state_dict()
    fresh = torch.optim.AdamW(net().parameters(), lr=0.01)
    fresh.load_state_dict(sd)                         # the same layout as the device optimizer's
    for a, b in zip(fresh.state.values(), plain.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in b)
    other = net()
    again = HostOptimizer(torch.optim.AdamW(other.parameters(), lr=0.5))
    again.load_state_dict(copy.deepcopy(plain.state_dict()))   # torch loads tensors by reference
    assert again.param_groups[0]["lr"] == 0.01       # hyperparameters come back up to the exposed groups
    with torch.no_grad():
        for q, p in zip(other.parameters(), ref.parameters()):
            q.copy_(p)
    train(ref, plain, 2)
    train(other, again, 2)
    assert all(torch.equal(a, b) for a, b in zip(params(ref), params(other)))


def test_the_meter_counts_no_state_on_the_device_and_the_host_holds_it():
    ref, off = net(), net()
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    host = HostOptimizer(torch.optim.AdamW(off.parameters(), lr=0.01))
    train(ref, plain, 1)
    train(off, host, 1)
    on_device, offloaded = MemoryMeter(label="a", cap=None), MemoryMeter(label="b", cap=None)
    on_device.set_fixed(ref, plain)
    offloaded.set_fixed(off, host)
    state = 2 * 8 * sum(p.numel() for p in ref.parameters())     # exp_avg, exp_avg_sq in float64
    assert on_device.fixed - offloaded.fixed == state
    copies = 2 * 8 * sum(p.numel() for p in ref.parameters())    # the parameters' and gradients' host copies
    assert host.host_bytes() == state + copies
    assert offload.needed_bytes(torch.optim.AdamW(ref.parameters())) == state + copies


def test_a_used_optimizer_or_a_closure_is_refused_in_one_line():
    model = net()
    opt = torch.optim.AdamW(model.parameters())
    train(model, opt, 1)
    with pytest.raises(UsageError, match="fresh optimizer"):
        HostOptimizer(opt)
    with pytest.raises(UsageError, match="closure"):
        HostOptimizer(torch.optim.AdamW(net().parameters())).step(lambda: 0.0)


def test_host_room_from_psutil_or_meminfo(monkeypatch):
    import sys

    free = offload.host_available_bytes()
    assert free is None or free > 0
    monkeypatch.setitem(sys.modules, "psutil", None)           # not installed: the kernel's MemAvailable
    fallback = offload.host_available_bytes()
    try:
        with open("/proc/meminfo") as f:
            has = any(line.startswith("MemAvailable:") for line in f)
    except OSError:
        has = False
    assert (fallback is not None and fallback > 0) == has


def test_memory_offload_setting_is_checked():
    assert Memory().offload_optimizer == "auto"
    assert Memory(offload_optimizer="always").offload_optimizer == "always"
    with pytest.raises(UsageError, match="offload_optimizer='sometimes'"):
        Memory(offload_optimizer="sometimes")
