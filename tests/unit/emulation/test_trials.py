"""A sweep's trial on an emulated device: `ctx.compute` lasts what the device's speed says (on the
controlled clock exactly, n·sample_s/speed), on a GPU and in a group trial it adds nothing, and
the target survives the trip to a spawned worker (pickled with the sweep's setup)."""

from __future__ import annotations

import pickle
import time

import pytest

from hetrain.emulation.trials import TARGET, EmulatedTarget
from hetrain.sweeping.objective import TrialContext, on_gpu


def context(**kw) -> TrialContext:
    return TrialContext(number=0, params={}, device="cpu", label="t4#0 (emulated)", **kw)


def timed(ctx, samples) -> float:
    t0 = time.perf_counter()
    with ctx.compute(samples=samples):
        pass
    return time.perf_counter() - t0


@pytest.mark.parametrize("speed", [1.0, 0.5])
def test_a_compute_on_the_controlled_clock_lasts_its_samples_over_the_speed(speed):
    ctx = context(speed=speed, sample_s=0.01, at_speed=TARGET.at_speed)
    assert timed(ctx, 4) == pytest.approx(4 * 0.01 / speed, abs=0.02)
    assert ctx.compute_s == pytest.approx(4 * 0.01 / speed, abs=0.02)


def test_a_gpu_and_a_group_trial_add_nothing():
    assert timed(context(speed=0.25, sample_s=0.05), 4) < 0.05                    # a GPU: no at_speed
    group = context(speed=0.25, sample_s=0.05, at_speed=TARGET.at_speed, world_size=2)
    assert timed(group, 4) < 0.05                                                  # the engine paces a group's ranks


def test_the_target_is_a_cpu_device_that_survives_pickling():
    target = pickle.loads(pickle.dumps(TARGET))
    assert isinstance(target, EmulatedTarget) and target == TARGET and not on_gpu(target) and on_gpu("0")
    assert target.torch_device == "cpu" and target.enter_ref == "hetrain.emulation.trials:enter"
    launch = target.group_launch(["a100-80g:1.0@80GiB", "t4:0.3@16GiB"], sample_s=0.01, run_dir="/tmp/x")
    assert launch["config"]["emulation"] == {"cluster": "a100-80g:1.0@80GiB,t4:0.3@16GiB", "sample_s": 0.01}
    assert launch["run_dir"] == "/tmp/x"
