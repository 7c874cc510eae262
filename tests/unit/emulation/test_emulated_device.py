"""The emulated device's process, throttle and memory meter."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch


def test_throttle_stretches_compute_to_the_emulated_speed():
    from hetrain.emulation.device import Throttle

    throttle = Throttle(0.5)
    t0 = time.perf_counter()
    with throttle.compute():
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    wall = time.perf_counter() - t0
    assert throttle.slept_seconds == pytest.approx(throttle.cpu_seconds)   # c·(1/0.5 − 1) = c
    assert wall >= 2 * throttle.cpu_seconds * 0.99



# Six 4 MiB tensors made and freed together, ten times. Whether glibc left to itself faults them in
# again each round depends on its heap's history (its adaptive mmap threshold, what sits at the
# heap's top): 0 to 245,450 faults here, by what the process had imported. So both processes
# start from glibc's fixed default (MALLOC_MMAP_THRESHOLD_ at 128 KiB: every such block mapped,
# and unmapped when freed), under which a plain process faults every round, and the emulated
# device must override it.
FREED_AND_MADE_AGAIN = """
import resource, sys, torch
from hetrain.emulation.device import become_emulated_device
if sys.argv[1] == "device":
    assert become_emulated_device() and torch.get_num_threads() == 1
def once():
    held = [torch.ones(2**20) for _ in range(6)]
    return sum(float(t[0]) for t in held)
for _ in range(3):
    once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's: Linux only")
def test_an_emulated_device_does_not_fault_in_again_what_it_freed():
    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", FREED_AND_MADE_AGAIN, mode], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert faults("plain") > 500       # what a step's page faults cost the device, without it
    assert faults("device") == 0


def test_noise_differs_between_devices_and_stays_within_its_band():
    from hetrain.emulation.device import Throttle

    a, b = Throttle(1.0, seed=1000), Throttle(1.0, seed=1001)
    a.noise = b.noise = 0.1
    draws_a = [a._stretch() for _ in range(200)]
    draws_b = [b._stretch() for _ in range(200)]
    assert draws_a != draws_b
    assert all(0.0 <= d <= 0.2 for d in draws_a)            # [1, 1.2] x: ±10% around +10%


def test_meter_counts_saved_activations_and_raises_the_cuda_oom_type():
    from hetrain.emulation.device import MemoryMeter

    lin = torch.nn.Linear(64, 64)
    meter = MemoryMeter(label="t", cap=None)
    meter.set_fixed(lin, None)
    with meter.forward():
        torch.tanh(lin(torch.randn(32, 64))).sum().backward()
    assert meter.activations >= 32 * 64 * 4           # at least the tanh output is saved
    tight = MemoryMeter(label="tight", cap=meter.fixed + 1024)
    tight.set_fixed(lin, None)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory \\(emulated\\)"):
        with tight.forward():
            torch.tanh(lin(torch.randn(32, 64)))


def test_meter_looks_up_a_forward_it_has_counted_and_still_raises_inside_the_forward():
    from hetrain.emulation import device as emulate
    from hetrain.emulation.device import MemoryMeter
    from hetrain.runtime.model import PreparedModel

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    meter = MemoryMeter(label="t", cap=None)
    meter.set_fixed(net, None)
    model = PreparedModel(net, net, meter)

    def run(n):
        model(torch.randn(n, 64)).sum().backward()
        return meter.activations

    first = run(32)
    assert first >= 2 * 32 * 64 * 4                          # the linear's input and the tanh's output
    assert [run(32) for _ in range(5)] == [first] * 5        # the same bytes, looked up
    assert meter.hooked_forwards == 1
    assert run(16) < first and meter.hooked_forwards == 2    # a new shape is counted
    for _ in range(emulate.RECOUNT_EVERY):
        run(32)
    assert meter.hooked_forwards == 3                        # counted again after RECOUNT_EVERY
    assert meter.peak == meter.fixed + first

    # A cap the known total does not fit: the forward is counted for real and raises inside it,
    # at the tensor that crosses the cap (the tanh's output, after the linear has run).
    meter.cap = meter.fixed + first - 1
    reached = []
    net[0].register_forward_hook(lambda *a: reached.append("linear"))
    with pytest.raises(torch.OutOfMemoryError):
        run(32)
    assert reached == ["linear"] and meter.hooked_forwards == 4


def test_throttle_sleeps_once_per_step_before_the_backward_that_syncs():
    from hetrain.emulation.device import Throttle

    throttle = Throttle(0.5)
    throttle.backward_ratio = 2.0
    guess = throttle.before_backward(0.01, settle=False)      # an earlier micro-batch: booked only
    assert throttle.slept_seconds == 0.0 and throttle.owed == pytest.approx(0.03)
    throttle.after_backward(0.01, guess, 0.02)                 # its backward took as guessed
    throttle.before_backward(0.01, settle=True)                # the last micro-batch: sleeps for both
    assert throttle.slept_seconds == pytest.approx(0.06) and throttle.owed == 0.0


def test_a_forward_whose_inputs_the_signature_cannot_describe_is_always_counted():
    from hetrain.runtime.model import _signature

    x = torch.zeros(4, 3)
    assert _signature((x,), {"mask": None}, True) == _signature((torch.ones(4, 3),), {"mask": None}, True)
    assert _signature((x,), {}, True) != _signature((torch.zeros(5, 3),), {}, True)
    assert _signature(({"ids": x},), {}, True) != _signature(({"ids": torch.zeros(2, 3)},), {}, True)

    class Batch:          # a batch object: its sizes are invisible to the signature
        pass
    assert _signature((Batch(),), {}, True) is None
    assert _signature((x, float("nan")), {}, True) is None


def test_a_recount_keeps_the_most_a_data_dependent_graph_saved():
    from hetrain.emulation import device as emulate
    from hetrain.emulation.device import MemoryMeter
    from hetrain.runtime.model import PreparedModel

    class Positive(torch.nn.Module):     # saves as much as its input has positive entries
        def forward(self, x):
            return torch.tanh(x[x > 0]).sum()

    net = Positive()
    meter = MemoryMeter(label="t", cap=None)
    model = PreparedModel(net, net, meter)
    few = torch.full((64,), -1.0)
    few[:4] = 1.0
    many = torch.ones(64)
    model(few.requires_grad_())
    small = meter.activations
    for _ in range(emulate.RECOUNT_EVERY - 1):
        model(many.requires_grad_())                 # looked up: still the small count
    assert meter.activations == small
    model(many.requires_grad_())                     # counted again: more
    large = meter.activations
    assert large > small
    model(few.requires_grad_())                      # looked up: the most found, not the last
    assert meter.activations == large


def test_a_clocked_pipeline_piece_lasts_its_length_over_the_speed_with_its_waits_inside():
    from hetrain.emulation.device import Throttle

    # 10 ms at speed 1 lasts 25 ms at 0.4: a piece that took 14 ms of wall (6 of CPU, the rest
    # waiting for a core) sleeps the 11 ms left, whatever its CPU took
    throttle = Throttle(0.4, sample_s=0.001)
    throttle.pay_clocked(0.010, 0.006, 0.014)
    assert throttle.slept_seconds == pytest.approx(0.011) and throttle.cpu_seconds == pytest.approx(0.006)
    # a piece that outlasted its length sleeps nothing and owes nothing: a slower device, not a debt
    throttle.pay_clocked(0.010, 0.030, 0.030)
    assert throttle.slept_seconds == pytest.approx(0.011) and throttle.owed == 0.0


def test_the_clocks_fixed_part_is_paid_once_per_micro_batch():
    from hetrain.emulation.device import Throttle

    # (4 ms + 3 x 1 ms) / 0.5 = 14 ms for a micro-batch of 3, of which 2 ms forward and a 4 ms
    # guessed backward are CPU: 8 ms of sleep; without the fixed part 6 ms less would be owed
    for micro_s, sleep in ((0.004, 0.008), (None, 0.0)):
        throttle = Throttle(0.5, sample_s=0.001, micro_s=micro_s)
        guess = throttle.before_backward(0.002, samples=3)
        assert guess == pytest.approx(0.004) and throttle.slept_seconds == pytest.approx(sleep)
    with pytest.raises(ValueError):
        Throttle(0.5, micro_s=0.004)             # a fixed part needs a clock
    fresh = Throttle(0.5, sample_s=0.001, micro_s=0.004).fresh()
    assert (fresh.speed, fresh.sample_s, fresh.micro_s, fresh.slept_seconds) == (0.5, 0.001, 0.004, 0.0)
