"""An emulated device as a pipeline stage asks it (emulation/pipeline.py), beside the answers of a
device that times its own work (runtime/layouts/pipeline/stage_hooks.py): the same questions, the
emulated answers only where the device is emulated."""

from __future__ import annotations

import pytest
import torch

from hetrain.emulation.device import MemoryMeter, Throttle
from hetrain.emulation.pipeline import EmulatedStage
from hetrain.emulation.sharing import SharedHost
from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile
from hetrain.runtime.layouts.pipeline.stage_hooks import StageHooks


def _profile() -> PipelineProfile:
    return PipelineProfile(blocks=(BlockCost(seconds=1.0), BlockCost(seconds=3.0)),
                           host={"contention": 1.2, "contention_at": 2, "message_s": 1e-3, "busy_message_s": 2e-3,
                                 "piece_overhead_s": 1e-4})


def test_every_question_a_stage_asks_has_an_emulated_answer():
    asked = {n for n in vars(StageHooks) if not n.startswith("_")}
    assert asked <= set(dir(EmulatedStage)), asked - set(dir(EmulatedStage))


def test_a_device_that_times_its_own_work_adds_nothing():
    plain, profile = StageHooks(), _profile()
    assert plain.as_run(profile) is profile and plain.micro_batch_s(4, 1.0, 4.0) is None
    assert plain.shared_host() is None and plain.predicted_step([], profile, step_s=1.0, global_batch=8) == {}
    assert plain.for_probe().counts_bytes is False and plain.host_said({}) == ""
    plain.hold(10 ** 12, 3)           # no allocator of its own to stand in for: nothing raised


def test_off_the_clock_the_stages_share_the_host_and_pieces_pay_their_wall_time():
    throttle = Throttle(0.5)
    stage = EmulatedStage(throttle)
    assert stage.as_run(_profile()) == _profile() and stage.micro_batch_s(4, 1.0, 4.0) is None
    assert isinstance(stage.shared_host(), SharedHost) and stage.shared_host().cores >= 1
    stage.piece_done(None, cpu_s=0.001, wall_s=0.002)     # a piece of 2 ms at speed 0.5: 2 ms more slept
    assert throttle.slept_seconds == pytest.approx(0.002, rel=0.5) and throttle.owed == 0.0
    probing = stage.for_probe()
    assert probing.throttle is not throttle and probing.throttle.speed == 0.5 and probing.counts_bytes
    assert probing.throttle.sample_s is None and probing.meter is None


def test_on_the_clock_the_blocks_and_pieces_follow_it_and_nothing_is_shared():
    throttle = Throttle(0.5, sample_s=0.01, micro_s=0.04)
    stage = EmulatedStage(throttle, sample_s=0.01)
    run = stage.as_run(_profile())
    assert run.stage_factor == 1.0 and sum(b.seconds for b in run.blocks) == pytest.approx(0.01)
    assert stage.micro_batch_s(8, 0.0025, 0.01) == pytest.approx(0.25 * (0.04 + 8 * 0.01))
    assert stage.shared_host() is None
    assert stage.predicted_step([], run, step_s=1.0, global_batch=8) == {}


def test_the_bytes_held_count_toward_the_peak_and_past_the_cap_raise_the_allocators_error():
    meter = MemoryMeter(label="small", cap=1000)
    meter.fixed = 600
    stage = EmulatedStage(Throttle(1.0), meter)
    stage.hold(300, 2)
    assert meter.peak == 900
    with pytest.raises(torch.OutOfMemoryError, match="500 B of activations for 3 micro-batch"):
        stage.hold(500, 3)


def test_the_probe_s_host_figures_are_said_and_played():
    from hetrain.emulation.sharing import host_figures, sharing

    profile = _profile()
    said = EmulatedStage(Throttle(1.0)).host_said(profile.host)
    assert "contention x1.20 with 2 at once" in said and "a message 1.00 ms (2.00 ms" in said
    assert sharing(profile) == dict(contention=1.2, contention_at=2, message_s=1e-3, busy_message_s=2e-3,
                                    overhead_s=1e-4)
    # a host with its overhead alone (one rank) plays as no host figures; none at all, the given contention
    assert sharing(PipelineProfile(blocks=profile.blocks, host={"piece_overhead_s": 1e-4}), 1.1, 2) == \
        dict(contention=1.1, contention_at=2)
    assert sharing(None) == dict(contention=1.0, contention_at=1)
    with pytest.raises(Exception, match="contention"):
        host_figures({"contention": 3.0})
