"""A pipeline stage on the controlled clock pays its share of the micro-batch's fixed part, and the
ranking puts the blocks on the clock from what the profiler measured, not from the clock's setting."""

from types import SimpleNamespace

import pytest

from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, StageDevice
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.measure.measurements import clocked_sample_s
from hetrain.runtime.layouts.pipeline.schedule import Pipeline
from hetrain.runtime.layouts.pipeline.stage_hooks import StageHooks


def blocks(*seconds: float) -> PipelineProfile:
    return PipelineProfile(blocks=tuple(BlockCost(seconds=s, activation_bytes=1.0, param_bytes=1.0) for s in seconds))


def stage(profile: PipelineProfile, index: int, *, sample_s: float | None, micro_s: float) -> SimpleNamespace:
    """What Pipeline.given_micro_s reads of a pipeline: its stage hooks (an emulated device's, whose
    throttle holds the clock), split, profile and place."""
    from hetrain.emulation.pipeline import EmulatedStage

    throttle = SimpleNamespace(sample_s=sample_s, micro_s=micro_s)
    return SimpleNamespace(_on=EmulatedStage(throttle, sample_s=sample_s), profile=profile, stage_index=index,
                           split=SimpleNamespace(bounds=((0, 1), (1, 4))), is_first=index == 0, is_last=index == 1)


@pytest.mark.parametrize("micro_s", [0.0, 0.04])
def test_a_stage_piece_lasts_its_share_of_the_fixed_part_and_of_the_samples(micro_s):
    clocked = blocks(1.0, 1.0, 1.0, 1.0).on_clock(0.010)       # 10 ms a sample: 2.5 ms a block
    first = Pipeline.given_micro_s(stage(clocked, 0, sample_s=0.010, micro_s=micro_s), 8)
    rest = Pipeline.given_micro_s(stage(clocked, 1, sample_s=0.010, micro_s=micro_s), 8)
    assert first == pytest.approx(0.25 * (micro_s + 8 * 0.010))
    assert rest == pytest.approx(0.75 * (micro_s + 8 * 0.010))
    # the stages together are one data-parallel micro-batch on the same clock: a + µ·T
    assert first + rest == pytest.approx(micro_s + 8 * 0.010)


def test_off_the_clock_a_stage_keeps_the_cpu_time():
    assert Pipeline.given_micro_s(stage(blocks(1.0, 1.0), 0, sample_s=None, micro_s=0.0), 4) is None


def test_a_device_that_times_its_own_work_gives_no_length():
    plain = SimpleNamespace(_on=StageHooks(), profile=blocks(1.0, 1.0), stage_index=0,
                            split=SimpleNamespace(bounds=((0, 1), (1, 2))), is_first=True, is_last=False)
    assert Pipeline.given_micro_s(plain, 4) is None
    assert Pipeline.given_micro_s(SimpleNamespace(**(vars(plain) | {"profile": None})), 4) is None


def test_the_ranking_reads_the_clock_from_the_fastest_measured_profile():
    def profile(name: str, per_sample_s: float) -> DeviceProfile:
        return DeviceProfile(device=name, source="measured", overhead_s=0.05, per_sample_s=per_sample_s,
                             fixed_bytes=0, activation_bytes_per_sample=1.0)

    # the fastest device runs at twice the unit speed: a sample at speed 1 takes twice its seconds
    devices = [StageDevice(name="a", speed=2.0), StageDevice(name="b", speed=1.0)]
    measured = [profile("a", 0.0131), profile("b", 0.0262)]
    assert clocked_sample_s(measured, devices) == pytest.approx(0.0262)
