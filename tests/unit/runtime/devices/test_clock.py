"""The clock home (runtime/devices/clock.py) and the asynchronous emulated device.

An asynchronous emulated device (HETRAIN_EMULATE_ASYNC=1) completes its work after the host call
returns, as a GPU does: its throttle's sleep is paid at the next sync point, not at the op. A host
clock read around its work (the old pipeline `timed`, the old optimizer `fixed_s`) then misses
the device's time, as a host clock misses a CUDA kernel; the device's clock reads it. CudaHooks is
run on the CPU with a stand-in for CUDA events (each stamped with the host's clock when recorded,
a GPU that runs as fast as it is launched), to pin how the last backward is timed."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from hetrain.hardware.cluster import parse_cluster
from hetrain.runtime.devices import clock as clocks
from hetrain.emulation.clock import EmulatedClock
from hetrain.emulation.device import EmulatedDevice, Throttle
from hetrain.runtime.devices.faults import FaultInjector
from hetrain.emulation.hooks import EmulatedHooks
from hetrain.runtime.devices.hooks import CudaHooks
from hetrain.runtime.loop.steps import MicroBatch

CPU = torch.device("cpu")


def spin(seconds: float) -> float:
    """Burn `seconds` of this thread's CPU; returns the CPU seconds taken."""
    c0 = time.thread_time()
    while time.thread_time() - c0 < seconds:
        pass
    return time.thread_time() - c0


def test_an_asynchronous_throttle_pays_at_the_sync_point_not_at_the_op():
    throttle = Throttle(0.01, asynchronous=True)
    t0 = time.perf_counter()
    with throttle.compute():
        cpu = spin(0.004)
    op_wall = time.perf_counter() - t0
    owed = throttle.owed
    assert owed == pytest.approx(99 * cpu, rel=0.05) and throttle.slept_seconds == 0.0
    assert throttle.charged_s == owed                      # the device's time, charged already
    assert op_wall < owed / 4                               # the host returned before the device was done
    t0 = time.perf_counter()
    clocks.synchronize(CPU)                                 # the host waits for the device here
    assert time.perf_counter() - t0 >= owed and throttle.owed == 0.0 and throttle.slept_seconds == owed
    sync = Throttle(0.1)
    with sync.compute():
        spin(0.01)
    assert sync.owed == 0.0 and sync.slept_seconds > 0      # the synchronous device sleeps at the op


def test_an_emulated_device_reads_the_async_mode_from_the_environment(monkeypatch):
    spec = parse_cluster("rtx3090:0.5")[0]
    monkeypatch.setenv("HETRAIN_EMULATE_ASYNC", "1")
    assert EmulatedDevice(spec).throttle.asynchronous and EmulatedDevice(spec).throttle.fresh().asynchronous
    monkeypatch.setenv("HETRAIN_EMULATE_ASYNC", "0")
    assert not EmulatedDevice(spec).throttle.asynchronous


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_pipeline_piece_reads_its_device_time_where_a_host_clock_misses_it_async(asynchronous):
    """The old pipeline `timed`: the host clock around the piece and its throttle's pay(). Under
    the async mode the pay sleeps nothing there, so that reading is the CPU's time alone; the
    device's clock (wall base, as pipeline_stage.MeteredStage times its pieces) reads c/speed."""
    speed = 0.25
    throttle = Throttle(speed, asynchronous=asynchronous)
    device = EmulatedClock(CPU, throttle, wall=True)
    readings, old = [], []
    for _ in range(3):
        start, t0 = device.mark(), time.perf_counter()
        w0 = time.perf_counter()
        spin(0.01)
        spent = time.perf_counter() - w0
        throttle.pay(spent)
        old.append((time.perf_counter() - t0) / spent)
        readings.append(device.seconds(start, device.mark()) / spent)
        clocks.sync_point()                  # between pieces: the send that waits for the device
    assert statistics.median(readings) == pytest.approx(1 / speed, rel=0.1)
    if asynchronous:
        assert statistics.median(old) < 0.5 / speed         # what the old `timed` read: the launch
    else:
        assert statistics.median(old) == pytest.approx(1 / speed, rel=0.2)


def test_a_piece_on_the_controlled_clock_lasts_its_length_however_late_the_host_wakes(monkeypatch):
    """A busy host wakes a sleeping process late (milliseconds a sleep, under load): that lateness
    is the host's, not the device's. A pipeline piece on the controlled clock reads its length on
    the device's clock (wall base) whatever the host added to the sleep that made it up."""
    import hetrain.emulation.device as emulated

    real_sleep, late = time.sleep, 0.03
    monkeypatch.setattr(emulated.time, "sleep", lambda s: real_sleep(s + late))
    throttle = Throttle(0.5, sample_s=0.01)
    device = EmulatedClock(CPU, throttle, wall=True)
    length = 0.02                                          # the piece's share of the clock at speed 1
    start, t0 = device.mark(), time.perf_counter()
    c0 = time.thread_time()
    spin(0.002)
    throttle.pay_clocked(length, time.thread_time() - c0, time.perf_counter() - t0)
    assert time.perf_counter() - t0 >= length / 0.5 + late                 # the host woke late ...
    assert device.seconds(start, device.mark()) == pytest.approx(length / 0.5, abs=0.005)   # ... the device did not


def test_the_optimizer_part_is_read_on_the_device_clock_under_the_async_mode():
    """fixed_s (the step's optimizer part): read as a busy-clock difference around the optimizer,
    and by fixed_start/fixed_end. The old busy clock (CPU + slept) read only the CPU under async."""
    speed = 0.25
    hooks = EmulatedHooks(CPU, EmulatedDevice(parse_cluster(f"rtx3090:{speed}")[0], asynchronous=True),
                          FaultInjector((), rank=0, attempt=0))
    busy0 = hooks.busy()
    hooks.fixed_start()
    with hooks.optimizer():
        cpu = spin(0.02)
    hooks.fixed_end()
    busy = hooks.busy() - busy0
    assert hooks.last_fixed_s() == pytest.approx(cpu / speed, rel=0.15)
    assert busy == pytest.approx(cpu / speed, rel=0.15)
    clocks.synchronize(CPU)
    assert hooks.last_fixed_s() == pytest.approx(cpu / speed, rel=0.15)   # read later: the same


class GpuTime:
    """The GPU's own timeline in these tests: the work below advances it by exactly its seconds, so
    the events read what a GPU's would, however busy the host running the test is (sleeps on a
    loaded host overshoot by tens of milliseconds, enough to move a 30 ms forward's ratio)."""

    now = 0.0

    @classmethod
    def run(cls, seconds: float) -> None:
        cls.now += seconds


class StampedEvent:
    """torch.cuda.Event on a CPU: stamped with the GPU's timeline (GpuTime) when recorded."""

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self, stream=None) -> None:
        self.at = GpuTime.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3


class Paced(torch.autograd.Function):
    """A layer whose forward takes `fwd` s and backward `bwd` s of the GPU's time."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        GpuTime.run(fwd)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        GpuTime.run(ctx.bwd)
        return grad, None, None


def cuda_micro_batch(hooks, model, mb, *, fwd, bwd):
    hooks.micro_batch_start(mb, 0)
    loss = Paced.apply(model(torch.ones(1, 4)), fwd, bwd).sum()
    hooks.before_backward(mb)
    loss.backward()
    hooks.after_backward(mb, 0.0)
    hooks.micro_batch_end(mb)


@pytest.fixture
def stamped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", StampedEvent)


def test_a_cuda_ranks_one_micro_batch_is_timed_to_its_last_gradient_not_by_a_fixed_ratio(stamped):
    """A rank that runs one micro-batch a step: its backward (3x its forward, as under activation
    checkpointing) is timed to its last gradient (an event from the gradient hooks), the wait for
    the gradient sync after it (here: a sleep in a later gradient hook, as DDP's finalize waits on
    the all-reduce) is sync, not compute. The old hooks took the backward as 2x the forward and
    counted the wait as compute (compute_s: the host clock from start to end)."""
    fwd, bwd, wait = 0.05, 0.15, 0.2
    model = torch.nn.Linear(4, 4, bias=False)
    hooks = CudaHooks(torch.device("cuda", 0))
    hooks.attach(model)
    model.weight.register_post_accumulate_grad_hook(lambda p: GpuTime.run(wait))   # the sync, after the gradient
    hooks.attempt_start()
    cuda_micro_batch(hooks, model, MicroBatch(batch=None, size=4, index=0, count=1, indices=(0, 1, 2, 3)),
                     fwd=fwd, bwd=bwd)
    busy, compute, sync = hooks.attempt_busy_s(), hooks.attempt_compute_s(), hooks.attempt_sync_s()
    assert fwd + bwd <= busy < fwd + bwd + 0.5 * wait
    assert compute == busy
    assert wait <= sync < wait + 0.5 * bwd


def test_without_gradient_hooks_a_cuda_ranks_last_backward_takes_the_ratio_of_earlier_steps(stamped):
    """Where no gradient hook fires (FSDP2's sharded gradients), the last backward is the forward
    times the backward/forward ratio measured on micro-batches that do not sync, kept across steps."""
    fwd, bwd, wait = 0.03, 0.12, 0.2
    model = torch.nn.Linear(4, 4, bias=False)
    hooks = CudaHooks(torch.device("cuda", 0))             # not attached: no gradient hooks
    hooks.attempt_start()                                  # a step with two micro-batches
    cuda_micro_batch(hooks, model, MicroBatch(batch=None, size=2, index=0, count=2, indices=(0, 1)), fwd=fwd, bwd=bwd)
    cuda_micro_batch(hooks, model, MicroBatch(batch=None, size=2, index=1, count=2, indices=(2, 3)), fwd=fwd, bwd=bwd)
    hooks.attempt_busy_s()
    assert hooks.backward_ratio == pytest.approx(bwd / fwd, rel=0.3)
    hooks.attempt_start()                                  # then one: its backward waits for the sync
    cuda_micro_batch(hooks, model, MicroBatch(batch=None, size=4, index=0, count=1, indices=(0, 1, 2, 3)),
                     fwd=fwd, bwd=bwd + wait)
    assert hooks.attempt_busy_s() == pytest.approx(fwd + bwd, rel=0.25)
    assert hooks.attempt_sync_s() == pytest.approx(wait, abs=0.5 * bwd)


def test_the_profiler_reads_an_asynchronous_device_on_its_clock(tmp_path, monkeypatch):
    """The profiler times an emulated device on its controlled clock through the device's throttle:
    under the async mode its sleeps are owed, not slept, and the device's busy clock still has them."""
    from hetrain.emulation.profiling import EmulatedPace
    from hetrain.runtime.measure.profiler import measure

    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path))
    clock_b, speed = 0.004, 0.5

    def loader(m):
        g = torch.Generator().manual_seed(1)
        return torch.randn(m, 32, generator=g), torch.randn(m, 8, generator=g)

    def once():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        return measure(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, device=CPU, label="cpu",
                       max_size=16, cpu_clock=True,
                       timed_by=EmulatedPace(Throttle(speed, sample_s=clock_b, micro_s=0.0,
                                                      asynchronous=True))).per_sample_s

    assert statistics.median(once() for _ in range(3)) == pytest.approx(clock_b / speed, rel=0.25)


def test_the_emulated_clock_adds_what_its_throttle_owes_and_a_plain_clock_adds_nothing():
    """EmulatedClock(device, t, wall=w) reads the time its throttle charged beyond the base (the
    owed sleep on the wall base; owed and slept on the CPU base) and what the host waited; a plain
    DeviceClock adds nothing to its base."""
    throttle = Throttle(0.5)
    throttle.charge(0.2)            # owed, not slept
    throttle.owed, throttle.slept_seconds = 0.1, 0.3
    for wall in (False, True):
        new = EmulatedClock(CPU, throttle, wall=wall)
        assert new.ahead_s() == pytest.approx(0.1 if wall else 0.4)
        assert new.waited_s() == 0.3
    plain = clocks.DeviceClock(CPU)
    assert plain.ahead_s() == 0.0 and plain.waited_s() == 0.0
    c0 = time.thread_time()
    assert c0 <= plain.mark() <= time.thread_time()