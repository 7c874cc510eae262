"""Pipeline partitioning by device speed and memory (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.runtime.layouts.pipeline.split import (BlockCost, PipelineProfile, StageDevice, bubble_fraction, evaluate_split,
                                             in_flight, split_pipeline)

from pipeline_cases import compositions, devices, profile

GIB = 1024**3


def test_bubble_fraction_and_activations_in_flight():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(2, 1) == pytest.approx(1 / 2)
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    with pytest.raises(UsageError, match="unknown pipeline schedule"):
        in_flight("zero-bubble", 0, 2, 2)


def test_faster_device_gets_more_blocks():
    prof = profile(12)
    assert split_pipeline(prof, devices(1.0, 1.0), micro_batches=8, micro_batch_size=4).sizes == (6, 6)
    split = split_pipeline(prof, devices(1.0, 0.5), micro_batches=8, micro_batch_size=4)
    assert split.sizes == (8, 4)
    uniform = evaluate_split(prof, devices(1.0, 0.5), (6, 6), micro_batches=8, micro_batch_size=4)
    assert uniform.bottleneck.index == 1
    assert uniform.bottleneck.seconds_per_micro / split.bottleneck.seconds_per_micro == pytest.approx(1.5)
    # fill-drain over 8 micro-batches: (6 + 12) + 7·12 = 102 units vs (8 + 8) + 7·8 = 72
    assert split.samples_per_s / uniform.samples_per_s == pytest.approx(102 / 72)
    assert any("uniform split 6/6" in r for r in split.reasons)
    assert split.bubble_fraction == pytest.approx(1 / 9)


def test_head_on_the_last_stage_moves_blocks_forward():
    prof = profile(6, last=BlockCost(seconds=2e-3, param_bytes=1e6))
    assert split_pipeline(prof, devices(1.0, 1.0), micro_batches=4, micro_batch_size=1).sizes == (4, 2)


def test_step_time_is_fill_drain_of_the_stage_times():
    split = evaluate_split(profile(4), devices(1.0, 0.5), (2, 2), micro_batches=3, micro_batch_size=2)
    t0, t1 = 2 * 2e-3 / 1.0, 2 * 2e-3 / 0.5
    assert split.step_seconds == pytest.approx(t0 + t1 + 2 * max(t0, t1))
    assert split.samples_per_s == pytest.approx(6 / split.step_seconds)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0.1, 10), min_size=2, max_size=8),
       speeds=st.lists(st.floats(0.2, 1.0), min_size=1, max_size=4),
       caps=st.lists(st.floats(2.0, 12.0), min_size=4, max_size=4))
def test_split_is_optimal_among_splits_that_fit(costs, speeds, caps):
    if len(speeds) > len(costs):
        return
    prof = PipelineProfile(blocks=tuple(BlockCost(seconds=c, activation_bytes=1.0, param_bytes=c)
                                        for c in costs))
    devs = [StageDevice(name=f"d{i}", speed=s, memory_bytes=caps[i] * sum(costs) / len(speeds))
            for i, s in enumerate(speeds)]
    kw = dict(micro_batches=4, micro_batch_size=1, schedule="1f1b", state_factor=1.0, memory_margin=0.0)
    options = [evaluate_split(prof, devs, sizes, **kw) for sizes in compositions(len(costs), len(devs))]
    fitting = [o for o in options if o.fits]
    if not fitting:
        with pytest.raises(UsageError, match="fits memory"):
            split_pipeline(prof, devs, **kw)
        return
    got = split_pipeline(prof, devs, **kw)
    assert got.fits
    best = min(o.bottleneck.seconds_per_micro for o in fitting)
    assert got.bottleneck.seconds_per_micro == pytest.approx(best)


def test_memory_limits_the_fast_device():
    # speed alone says 8/4; the fast device only holds 5 blocks' state
    prof = profile(12, act=0.0, params=1 * GIB)
    devs = [StageDevice(name="small-fast", speed=1.0, memory_bytes=22 * GIB),
            StageDevice(name="big-slow", speed=0.5, memory_bytes=80 * GIB)]
    split = split_pipeline(prof, devs, micro_batches=4, micro_batch_size=1, state_factor=4.0, memory_margin=0.0)
    assert split.sizes == (5, 7)
    assert all(s.fits for s in split.stages)


def test_schedule_decides_what_fits_and_gpipe_suggests_1f1b():
    prof = profile(4, act=1 * GIB, params=0.0)
    devs = devices(1.0, 1.0, memory=4.5 * GIB)      # 2 blocks x 2 micro-batches in flight fit, 8 do not
    ok = split_pipeline(prof, devs, micro_batches=8, micro_batch_size=1, schedule="1f1b", memory_margin=0.0)
    assert ok.sizes == (2, 2) and [s.in_flight for s in ok.stages] == [2, 1]
    with pytest.raises(UsageError) as e:
        split_pipeline(prof, devs, micro_batches=8, micro_batch_size=1, schedule="gpipe", memory_margin=0.0)
    assert "8 micro-batches in flight" in e.value.what and "schedule='1f1b'" in e.value.fix
    assert "activation checkpointing" in e.value.fix and "FSDP" in e.value.fix


def test_impossible_splits_say_what_to_try():
    with pytest.raises(UsageError) as e:
        split_pipeline(profile(3), devices(1, 1, 1, 1), micro_batches=4, micro_batch_size=1)
    assert "cannot cut 3 blocks into 4 pipeline stages" in e.value.what and "at most 3 stages" in e.value.fix
    with pytest.raises(UsageError) as e:   # nothing fits: names the stage, its memory, and the cap
        split_pipeline(profile(4, params=1 * GIB), devices(1, 1, memory=2 * GIB), micro_batches=2,
                       micro_batch_size=1)
    assert "no split of 4 blocks over 2 stages fits memory" in e.value.what and "usable" in e.value.what
    assert "sharding" in e.value.fix and "checkpointing" in e.value.fix
    with pytest.raises(UsageError, match="needs at least 3 micro-batches"):
        split_pipeline(profile(6), devices(1, 1, 1), micro_batches=2, micro_batch_size=1, schedule="1f1b")
    with pytest.raises(UsageError, match="does not cut 12 blocks into 2 stages"):
        evaluate_split(profile(12), devices(1, 1), (6, 5), micro_batches=2, micro_batch_size=1)
    with pytest.raises(UsageError, match="speed"):
        StageDevice(name="x", speed=0.0)
    with pytest.raises(UsageError, match="no blocks"):
        PipelineProfile(blocks=())


def test_tied_weight_counts_once_on_a_single_stage_and_twice_across_stages():
    end = BlockCost(seconds=0.0, param_bytes=100.0)
    prof = profile(2, params=0.0, act=0.0, first=end, last=end, tied=100.0)
    one = evaluate_split(prof, devices(1.0), (2,), micro_batches=1, micro_batch_size=1, state_factor=1.0)
    two = evaluate_split(prof, devices(1.0, 1.0), (1, 1), micro_batches=1, micro_batch_size=1, state_factor=1.0,
                         schedule="gpipe")
    assert one.stages[0].state_bytes == 100.0
    assert [s.state_bytes for s in two.stages] == [100.0, 100.0]
    assert prof.param_bytes == 100.0


def test_a_stage_s_factor_stretches_every_stage_s_blocks_and_survives_the_json_round_trip():
    """stage_factor: a stage's pieces' time over its blocks' profiled time (runtime/measure/
    pipeline_probe.py measures it). Stage time f·µ·Σ seconds / speed: the split is the same, the
    step f times longer."""
    plain = profile(12)                                  # 1 ms a sample a block
    slower = replace(plain, stage_factor=1.4)
    split = evaluate_split(slower, devices(1.0, 0.5), (8, 4), micro_batches=8, micro_batch_size=4)
    assert [s.seconds_per_micro for s in split.stages] == pytest.approx([1.4 * 4 * 8e-3, 1.4 * 4 * 4e-3 / 0.5])
    bare = split_pipeline(plain, devices(1.0, 0.5), micro_batches=8, micro_batch_size=4)
    stretched = split_pipeline(slower, devices(1.0, 0.5), micro_batches=8, micro_batch_size=4)
    assert bare.sizes == stretched.sizes == (8, 4)
    assert bare.samples_per_s / stretched.samples_per_s == pytest.approx(1.4)
    assert PipelineProfile.from_dict(slower.to_dict()) == slower
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(UsageError, match="stage_factor"):
            replace(plain, stage_factor=bad)


def test_a_fixed_cost_per_block_is_paid_per_micro_batch_at_the_device_s_speed():
    """block_s: seconds a block per micro-batch whatever its size (the machinery around its ops),
    paid at the stage's device speed, so it weighs most at small micro-batches."""
    plain = profile(12)                                  # 1 ms a sample a block
    fixed = replace(plain, block_s=0.004)                # 4 ms a block a micro-batch
    split = evaluate_split(fixed, devices(1.0, 0.5), (8, 4), micro_batches=8, micro_batch_size=4)
    assert [s.seconds_per_micro for s in split.stages] == pytest.approx([8 * (4e-3 + 4e-3), 4 * (4e-3 + 4e-3) / 0.5])
    one = evaluate_split(fixed, devices(1.0, 0.5), (8, 4), micro_batches=8, micro_batch_size=1)
    assert [s.seconds_per_micro for s in one.stages] == pytest.approx([8 * (1e-3 + 4e-3), 4 * (1e-3 + 4e-3) / 0.5])
    assert PipelineProfile.from_dict(fixed.to_dict()) == fixed
    with pytest.raises(UsageError, match="block_s"):
        replace(plain, block_s=-1.0)


def test_blocks_on_the_controlled_clock_share_it_as_measured():
    prof = PipelineProfile(blocks=(BlockCost(seconds=2.0), BlockCost(seconds=1.0), BlockCost(seconds=1.0)),
                           first=BlockCost(seconds=0.5), last=BlockCost(seconds=0.5), stage_factor=1.3, block_s=0.01)
    clocked = prof.on_clock(0.01)
    # the whole model lasts the clock a sample at speed 1, its parts keeping their shares
    assert clocked.stage_seconds(0, 3, first=True, last=True) == pytest.approx(0.01)
    assert clocked.stage_seconds(0, 1, first=True, last=False) == pytest.approx(0.01 * 2.5 / 5)
    assert clocked.stage_seconds(1, 3, first=False, last=True) == pytest.approx(0.01 * 2.5 / 5)
    # a stage runs them in exactly that: no per-block or per-row excess
    assert (clocked.stage_factor, clocked.block_s) == (1.0, 0.0) and "controlled clock" in clocked.source
    with pytest.raises(UsageError, match="controlled clock"):
        prof.on_clock(0.0)
