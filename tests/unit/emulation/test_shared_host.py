"""What emulated devices sharing one host add to the cost model (emulation/sharing.py's SharedHost,
which the profiles carry): stragglers, the controlled clock, cores shared with each other and
with other work, contention, and a step's last micro-batch's pacing and DDP costs."""

from __future__ import annotations

import pytest

from hetrain.emulation.sharing import SharedHost, _compute_segments, shared_cpu_finish, straggle_at
from hetrain.errors import UsageError
from hetrain.planning.collectives import FREE_LINK
from hetrain.planning.cost import Assignment, step_cost
from hetrain.planning.profile import DeviceProfile


def _prof(per_sample, cpu_share=0.0, overhead=0.0, opt=0.0):
    return DeviceProfile(device=f"d{per_sample}", source="t", overhead_s=overhead, per_sample_s=per_sample,
                         optimizer_s=opt, fixed_bytes=0, activation_bytes_per_sample=0, cpu_share=cpu_share)


def test_stragglers_and_the_agreement_lengthen_the_step():
    a = Assignment(profile=_prof(0.01, opt=0.005), share=40, micro_batch=40)
    b = Assignment(profile=_prof(0.02, opt=0.004), share=20, micro_batch=20)
    base = step_cost([a, b], global_batch=60, grad_bytes=0, link=FREE_LINK)
    cost = step_cost([a, b], global_batch=60, grad_bytes=0, link=FREE_LINK, agree_s=0.002, host=SharedHost(straggle=0.1))
    assert cost.straggle_s == pytest.approx(0.1 * 0.4) and cost.agree_s == 0.002
    assert cost.step_s == pytest.approx(base.step_s + 0.04 + 0.002)
    # One device has no peer to wait for.
    assert step_cost([a], global_batch=40, grad_bytes=0, link=FREE_LINK, host=SharedHost(straggle=0.1)).straggle_s == 0.0


def test_on_the_controlled_clock_only_the_last_backward_can_trail():
    from dataclasses import replace

    # the clock's profiles: 10 ms a sample at speed 1 and 20 at 0.5, of which 3 ms a sample is CPU
    a = Assignment(profile=replace(_prof(0.01), cpu_share=0.3), share=40, micro_batch=10)
    b = Assignment(profile=replace(_prof(0.02), cpu_share=0.15), share=20, micro_batch=20)
    kw = dict(global_batch=60, grad_bytes=0, link=FREE_LINK)
    wall = step_cost([a, b], **kw, host=SharedHost(straggle=0.1))
    clocked = step_cost([a, b], **kw, host=SharedHost(straggle=0.1, clocked=True))
    assert wall.straggle_s == pytest.approx(0.1 * 0.4)           # the whole step's compute can trail
    # a is critical (0.4 s, ties b): its last micro-batch of 10 holds 30 ms of CPU, 2/3 of it the backward
    assert clocked.bottleneck == 0
    assert clocked.straggle_s == pytest.approx(0.1 * 10 * 0.01 * 0.3 * 2 / 3)
    assert clocked.step_s == pytest.approx(wall.step_s - wall.straggle_s + clocked.straggle_s)


def test_straggling_measured_under_contention_scales_with_the_steps_own_contention():
    assert straggle_at(0.03, 1.0, 1.0) == 0.03            # measured without contention: as measured
    assert straggle_at(0.15, 1.5, 1.25) == pytest.approx(0.075)
    assert straggle_at(0.15, 1.5, 1.0) == 0.0             # a step that fits the cores: none
    assert straggle_at(0.15, 1.5, 2.0) == 0.15            # never more than was measured


def test_devices_sharing_too_few_cores_stretch_their_compute():
    # Three emulated devices that each keep a core busy all the time, on two cores: ×1.5.
    devs = [Assignment(profile=_prof(0.01, cpu_share=1.0), share=10, micro_batch=10) for _ in range(3)]
    cost = step_cost(devs, global_batch=30, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=2))
    assert cost.stretch == pytest.approx(1.5, rel=1e-9) and cost.step_s == pytest.approx(0.15, rel=1e-9)
    # Enough cores, or real GPUs (no host CPU share): no stretch.
    assert step_cost(devs, global_batch=30, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=3)).stretch == 1.0
    gpus = [Assignment(profile=_prof(0.01), share=10, micro_batch=10) for _ in range(3)]
    assert step_cost(gpus, global_batch=30, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=2)).stretch == 1.0


def test_the_emulators_forward_sleep_backward_on_one_core_by_hand():
    """A (speed 1): forward 10 ms, backward 20 ms of CPU. B (speed 0.5): forward 10, sleep 30,
    backward 20. On one core both forwards share it (done at 20 ms); A's backward runs alone (40);
    B wakes at 50 and runs its backward alone (70)."""
    a = Assignment(profile=_prof(0.003, cpu_share=1.0), share=10, micro_batch=10)
    b = Assignment(profile=_prof(0.006, cpu_share=0.5), share=10, micro_batch=10)
    assert shared_cpu_finish([[(True, 0.01), (True, 0.02)], [(True, 0.01), (False, 0.03), (True, 0.02)]], 1) \
        == pytest.approx([0.04, 0.07])
    cost = step_cost([a, b], global_batch=20, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=1))
    assert cost.compute_s == pytest.approx((0.04, 0.07))
    assert cost.stretch_by_device == pytest.approx((4 / 3, 7 / 6)) and cost.bottleneck == 1


def test_other_work_on_the_host_stretches_compute_too():
    # One always-busy device beside 3 other runnable processes on 2 cores: each gets half a core.
    dev = [Assignment(profile=_prof(0.01, cpu_share=1.0), share=10, micro_batch=10)]
    cost = step_cost(dev, global_batch=10, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=2, load=3))
    assert cost.stretch == pytest.approx(2.0, rel=1e-9) and cost.step_s == pytest.approx(0.2, rel=1e-9)
    # Speed 0.5: 100 ms of CPU at half a core (200 ms) plus its 100 ms of sleep: ×1.5.
    half = [Assignment(profile=_prof(0.02, cpu_share=0.5), share=10, micro_batch=10)]
    f = step_cost(half, global_batch=10, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=2, load=3)).stretch
    assert f == pytest.approx(1.5, rel=1e-9)


def test_an_emulated_device_computes_its_micro_batches_then_sleeps_once_before_the_last_backward():
    # Speed 0.5, 3 micro-batches of 10 ms device time each (5 ms of CPU), forward a third of it.
    p = DeviceProfile(device="d", source="t", overhead_s=0.0, per_sample_s=0.001, fixed_bytes=0,
                      activation_bytes_per_sample=0, cpu_share=0.5, forward_fraction=1 / 3)
    segs = _compute_segments(Assignment(profile=p, share=30, micro_batch=10))
    assert [on for on, _ in segs] == [True, False, True]
    cpu_before, sleep, cpu_after = (d for _, d in segs)
    assert cpu_after == pytest.approx(0.005 * 2 / 3)           # the last backward
    assert cpu_before == pytest.approx(0.015 - 0.005 * 2 / 3)  # everything else on the CPU first
    assert sleep == pytest.approx(0.015)                       # then one sleep for the whole step


def test_devices_computing_at_once_slow_each_other_by_the_measured_contention():
    """Two CPU jobs of 0.1 s on 2 cores: alone they finish at 0.1; measured 20% slower when two
    compute at once, both finish at 0.12; a job that computes while the other sleeps is not slowed."""
    both = [[(True, 0.1)], [(True, 0.1)]]
    assert shared_cpu_finish(both, 2) == pytest.approx([0.1, 0.1])
    assert shared_cpu_finish(both, 2, contention=1.2, contention_at=2) == pytest.approx([0.12, 0.12])
    staggered = [[(True, 0.1)], [(False, 0.1), (True, 0.1)]]
    assert shared_cpu_finish(staggered, 2, contention=1.2, contention_at=2) == pytest.approx([0.1, 0.2])
    # three at once on 3 cores, measured at 3: 1.5x; two of them at once: 1.25x
    assert shared_cpu_finish([[(True, 0.1)]] * 2, 3, contention=1.5, contention_at=3) == pytest.approx([0.125] * 2)


def test_a_steps_last_micro_batch_pays_its_pacing_and_ddps_cost_once():
    # Speed 0.5, 3 micro-batches of 10 ms device time (5 ms of CPU); paced, the last costs 4% more
    # CPU, and through DDP 5% more again: 10 ms × (1.04 · 1.05 − 1) = 0.92 ms more device time
    p = DeviceProfile(device="d", source="t", overhead_s=0.0, per_sample_s=0.001, fixed_bytes=0,
                      activation_bytes_per_sample=0, cpu_share=0.5, forward_fraction=1 / 3, paced_cost=1.04)
    a = Assignment(profile=p, share=30, micro_batch=10)
    extra = 0.010 * (1.04 * 1.05 - 1)
    assert a.last_micro_extra(1.05) == pytest.approx(extra)
    assert a.compute_s(ddp_cost=1.05) == pytest.approx(0.030 + extra)
    cpu_before, sleep, cpu_after = (d for _, d in _compute_segments(a, 1.05))
    assert cpu_before == pytest.approx(0.015 - 0.005 * 2 / 3)  # the earlier work as before
    assert cpu_after == pytest.approx(0.005 * 2 / 3 + extra / 2)   # the extra CPU after the last backward's sleep
    assert cpu_before + sleep + cpu_after == pytest.approx(0.030 + extra)
    alone = step_cost([a], global_batch=30, grad_bytes=0, link=FREE_LINK, host=SharedHost(cores=2, ddp_cost=1.05))
    assert alone.compute_s[0] == pytest.approx(0.030 + extra) and alone.stretch == pytest.approx(1.0)
    # a GPU's profile is not paced and its DDP runs on the GPU: nothing added
    gpu = Assignment(profile=_prof(0.001), share=30, micro_batch=10)
    assert gpu.compute_s() == pytest.approx(0.030) and gpu.last_micro_extra() == 0.0
    with pytest.raises(UsageError, match="paced cost"):
        DeviceProfile(device="d", source="t", overhead_s=0.0, per_sample_s=0.001, fixed_bytes=0,
                      activation_bytes_per_sample=0, paced_cost=0.9)


def test_the_profiles_carry_the_host_the_cost_model_plays_out():
    """What the cost model was given as planner options it now reads off the profiles: the same
    step from host=... and from profiles that carry the host; a profile's JSON never holds it."""
    from dataclasses import replace

    host = SharedHost(cores=2, contention=1.2, contention_at=2, straggle=0.05, straggle_stretch=1.5)
    devs = [Assignment(profile=_prof(0.01, cpu_share=1.0), share=10, micro_batch=10) for _ in range(3)]
    given = step_cost(devs, global_batch=30, grad_bytes=0, link=FREE_LINK, host=host)
    carried = [replace(a, profile=replace(a.profile, host=host)) for a in devs]
    assert step_cost(carried, global_batch=30, grad_bytes=0, link=FREE_LINK) == given
    assert given.stretch > 1.5 and given.straggle_s > 0
    assert "host" not in carried[0].profile.to_dict()
    assert DeviceProfile.from_dict(carried[0].profile.to_dict()) == carried[0].profile   # host not compared


def test_a_bad_host_figure_is_refused_with_its_fix():
    with pytest.raises(UsageError, match="contention"):
        SharedHost(contention=0.5)
    with pytest.raises(UsageError, match="DDP's cost"):
        SharedHost(ddp_cost=0.5)
    with pytest.raises(UsageError, match="host cores"):
        SharedHost(cores=0)
