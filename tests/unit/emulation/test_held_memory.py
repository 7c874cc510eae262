"""Emulated OOMs occupy memory: the failed graph stays held (and the device full) until it is
released, so a recovery that allocates first fails a second time, as on a GPU."""

from __future__ import annotations

import pytest
import torch

from hetrain.emulation.device import MemoryMeter
from hetrain.runtime.resilience import oom

CPU = torch.device("cpu")


def net_and_meter(cap=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                              torch.nn.Tanh(), torch.nn.Linear(32, 1))
    meter = MemoryMeter(label="dev", cap=cap)
    meter.set_fixed(net, None)
    return net, meter


def allocate(meter):
    with meter.allocating():
        return torch.zeros(256)


def failing_backward(net, meter):
    """A backward that runs out of memory halfway (the middle Linear's weight gradient)."""
    def boom(grad):
        meter.out_of_memory()
        raise torch.OutOfMemoryError("injected")
    handle = net[2].weight.register_hook(boom)
    with meter.forward():
        loss = torch.nn.functional.mse_loss(net(torch.randn(8, 16)), torch.zeros(8, 1))
    return loss, handle


def test_a_recovery_inside_the_except_block_runs_out_of_memory_again():
    oom.keep_anchor(CPU)
    net, meter = net_and_meter()
    loss, handle = failing_backward(net, meter)
    try:
        loss.backward()
    except torch.OutOfMemoryError:
        assert meter.ledger.held_bytes > 0           # the unexecuted half of the graph
        with pytest.raises(torch.OutOfMemoryError, match="failed graph still holds"):
            allocate(meter)
    handle.remove()


def test_dropping_references_is_not_enough_the_engine_must_be_drained():
    """torch's autograd engine keeps a failed backward's queued nodes (and the graph behind them)
    until a later backward pops them: `release_graph` drains them, then the memory is back."""
    oom.keep_anchor(CPU)
    net, meter = net_and_meter()
    loss, handle = failing_backward(net, meter)
    try:
        loss.backward()
    except torch.OutOfMemoryError:
        pass
    handle.remove()
    del loss
    assert meter.ledger.held_bytes > 0
    with pytest.raises(torch.OutOfMemoryError):
        allocate(meter)
    oom.release_graph(CPU)
    assert meter.ledger.held_bytes == 0
    assert allocate(meter).shape == (256,)


def test_the_caller_s_loss_is_detached_and_the_graph_freed():
    oom.keep_anchor(CPU)
    net, meter = net_and_meter()
    loss, handle = failing_backward(net, meter)
    try:
        loss.backward()
    except torch.OutOfMemoryError:
        pass
    handle.remove()
    oom.release_graph(CPU, loss)                      # the caller keeps `loss`: detached in place
    assert loss.grad_fn is None and meter.ledger.held_bytes == 0
    assert allocate(meter).shape == (256,)


def test_a_cap_oom_in_the_forward_holds_its_partial_graph_until_the_traceback_goes():
    net, meter = net_and_meter()
    with meter.forward():
        net(torch.randn(8, 16))
    meter.cap = meter.fixed + meter.activations // 2     # the next forward crosses it halfway
    try:
        with meter.forward():
            net(torch.randn(8, 16))
    except torch.OutOfMemoryError:
        assert meter.ledger.held_bytes > 0
        with pytest.raises(torch.OutOfMemoryError):
            allocate(meter)
    assert meter.ledger.held_bytes == 0
    assert allocate(meter).shape == (256,)


def test_saved_tensors_unpack_to_the_same_gradients():
    net, meter = net_and_meter()
    x = torch.randn(8, 16)
    with meter.forward():
        loss = net(x).pow(2).mean()
    loss.backward()
    metered = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).pow(2).mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(metered, net.parameters()))
    assert meter.ledger.live == {}                    # every saved tensor released by the backward
