"""The emulated device's throttle and memory meter, in one process."""

from __future__ import annotations

import time

import pytest
import torch


def test_throttle_stretches_compute_to_the_emulated_speed():
    from hetrain.runtime.emulate import Throttle

    throttle = Throttle(0.5)
    t0 = time.perf_counter()
    with throttle.compute():
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    wall = time.perf_counter() - t0
    assert throttle.slept_seconds == pytest.approx(throttle.cpu_seconds)   # c·(1/0.5 − 1) = c
    assert wall >= 2 * throttle.cpu_seconds * 0.99



def test_noise_differs_between_devices_and_stays_within_its_band():
    from hetrain.runtime.emulate import Throttle

    a, b = Throttle(1.0, seed=1000), Throttle(1.0, seed=1001)
    a.noise = b.noise = 0.1
    draws_a = [a._stretch() for _ in range(200)]
    draws_b = [b._stretch() for _ in range(200)]
    assert draws_a != draws_b
    assert all(0.0 <= d <= 0.2 for d in draws_a)            # [1, 1.2] x: ±10% around +10%


def test_meter_counts_saved_activations_and_raises_the_cuda_oom_type():
    from hetrain.runtime.emulate import MemoryMeter

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
