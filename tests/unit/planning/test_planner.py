"""The planner: properties over random devices, exactness against brute force, timing, bad input."""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.planning.collectives import FREE_LINK, Link
from hetrain.planning.cost import Assignment, step_cost
from hetrain.planning.plan import Plan
from hetrain.planning.planner import PlanOptions, make_plan
from hetrain.planning.profile import DeviceProfile

MIB = 1024**2


@st.composite
def devices(draw, i: int = 0):
    memory = draw(st.one_of(st.none(), st.integers(40, 400)))
    return DeviceProfile(
        device=f"dev{i}-{draw(st.integers(0, 10**6))}", source="hypothesis",
        overhead_s=draw(st.floats(0.0, 0.02)), per_sample_s=draw(st.floats(1e-4, 0.05)),
        optimizer_s=draw(st.floats(0.0, 0.02)), fixed_bytes=20 * MIB,
        activation_bytes_per_sample=draw(st.floats(0.5, 8.0)) * MIB,
        activation_fixed_bytes=draw(st.floats(0.0, 4.0)) * MIB,
        memory_bytes=None if memory is None else memory * MIB, checkpoint_fraction=0.25)


@st.composite
def clusters(draw, min_size=1, max_size=6):
    n = draw(st.integers(min_size, max_size))
    return [draw(devices(i)) for i in range(n)]


def options(batch, **kw):
    return PlanOptions(global_batch=batch, **kw)


def plan_or_none(profiles, o):
    try:
        return make_plan(profiles, o)
    except UsageError:
        return None


@settings(max_examples=150, deadline=None)
@given(profiles=clusters(), batch=st.integers(1, 300), exclude=st.booleans(), ckpt=st.booleans())
def test_shares_sum_to_the_batch_and_every_device_is_in_or_explained(profiles, batch, exclude, ckpt):
    o = options(batch, allow_exclusion=exclude, allow_checkpointing=ckpt, memory_margin=0.1)
    if batch < len(profiles):
        with pytest.raises(UsageError, match="smaller than the"):
            make_plan(profiles, o)
        return
    plan = plan_or_none(profiles, o)
    if plan is None:
        return        # a device (or every device) cannot fit one sample: checked below
    assert sum(plan.shares) == batch and min(plan.shares) >= 1
    assert len(plan.devices) + len(plan.excluded) == len(profiles)
    if not exclude:
        assert not plan.excluded and [d.device for d in plan.devices] == [p.device for p in profiles]
    for e in plan.excluded:
        assert e.reason and e.fix and e.kind in ("slow", "memory")
    assert [d.rank for d in plan.devices] == list(range(len(plan.devices)))


@settings(max_examples=150, deadline=None)
@given(profiles=clusters(), batch=st.integers(6, 300), margin=st.floats(0.0, 0.3))
def test_memory_caps_are_respected(profiles, batch, margin):
    plan = plan_or_none(profiles, options(batch, memory_margin=margin))
    assume(plan is not None)
    by_name = {p.device: p for p in profiles}
    for d in plan.devices:
        p = by_name[d.device]
        biggest = max(d.micro_sizes())
        assert biggest <= d.micro_batch
        if p.memory_bytes is not None:
            need = p.memory_needed(biggest, checkpointing=d.checkpointing)
            assert need <= p.memory_bytes * (1 - margin) + 1e-6
            assert d.predicted_memory_bytes == int(need)
    for e in plan.excluded:
        if e.kind == "memory":
            p = by_name[e.device]
            assert p.memory_needed(1, checkpointing=True) > p.memory_bytes * (1 - margin)


@settings(max_examples=150, deadline=None)
@given(profiles=clusters(max_size=5), extra=devices(99), batch=st.integers(6, 300))
def test_more_devices_are_never_predicted_slower_when_communication_is_free(profiles, extra, batch):
    o = options(batch, link=FREE_LINK)
    fewer = plan_or_none(profiles, o)
    more = plan_or_none(profiles + [extra], o)
    assume(fewer is not None)
    assert more is not None
    assert more.predicted["step_s"] <= fewer.predicted["step_s"] * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(device=devices(), n=st.integers(1, 8), batch=st.integers(8, 500), exclude=st.booleans())
def test_equal_devices_get_equal_shares(device, n, batch, exclude):
    profiles = [replace(device, device=f"same{i}") for i in range(n)]
    plan = plan_or_none(profiles, options(batch, allow_exclusion=exclude, link=FREE_LINK))
    assume(plan is not None)
    shares = plan.shares
    assert max(shares) - min(shares) <= 1
    if batch % len(shares) == 0:
        assert len(set(shares)) == 1


@settings(max_examples=150, deadline=None)
@given(profiles=clusters(min_size=2, max_size=5), batch=st.integers(10, 300), which=st.integers(0, 4),
       faster=st.floats(1.05, 4.0), exclude=st.booleans())
def test_monotone_in_speed(profiles, batch, which, faster, exclude):
    """A faster device never makes the predicted step longer, nor gets a smaller share."""
    i = which % len(profiles)
    o = options(batch, allow_exclusion=exclude, link=FREE_LINK)
    before = plan_or_none(profiles, o)
    assume(before is not None)
    quick = list(profiles)
    quick[i] = profiles[i].scaled(1 / faster)
    after = make_plan(quick, o)
    assert after.predicted["step_s"] <= before.predicted["step_s"] * (1 + 1e-9)
    share = {d.device: d.share for d in before.devices}.get(profiles[i].device, 0)
    assert {d.device: d.share for d in after.devices}.get(profiles[i].device, 0) >= share


def _brute_force_compute(profiles, fits_micro, batch):
    """Smallest max compute over every split with each device >= 1 (tiny cases)."""
    best = math.inf
    n = len(profiles)
    for cut in itertools.combinations(range(1, batch), n - 1):
        shares = [b - a for a, b in zip((0, *cut), (*cut, batch))]
        t = max(Assignment(profile=p, share=s, micro_batch=min(m, s)).compute_s()
                for p, s, m in zip(profiles, shares, fits_micro))
        best = min(best, t)
    return best


@settings(max_examples=80, deadline=None)
@given(profiles=clusters(min_size=1, max_size=3), batch=st.integers(3, 14))
def test_forced_split_is_the_exact_optimum(profiles, batch):
    assume(batch >= len(profiles))
    o = options(batch, allow_exclusion=False, allow_checkpointing=False, link=FREE_LINK)
    plan = plan_or_none(profiles, o)
    assume(plan is not None)
    micro = [p.max_micro_batch(margin=0.1) or batch for p in profiles]
    got = max(d.predicted_compute_s for d in plan.devices)
    assert got == pytest.approx(_brute_force_compute(profiles, micro, batch), rel=1e-9)


def _profile(name, per_sample, overhead=0.0, opt=0.0, memory=None):
    return DeviceProfile(device=name, source="test", overhead_s=overhead, per_sample_s=per_sample,
                         optimizer_s=opt, fixed_bytes=100 * MIB, activation_bytes_per_sample=10 * MIB,
                         memory_bytes=memory)


def test_seed_pair_splits_by_speed_and_beats_equal_ddp():
    a100, r3090 = _profile("a100", 1 / 120), _profile("3090", 1 / 80)
    plan = make_plan([a100, r3090], options(64, link=FREE_LINK))
    assert plan.shares in ((38, 26), (39, 25))     # both finish in 26/80 = 39/120 s: a tie
    p = plan.predicted
    # Compute-bound, no overheads: hetrain reaches the sum of speeds (within the integer split);
    # equal-split DDP runs at twice the slower card.
    assert p["samples_per_s"] == pytest.approx(64 / (26 / 80), rel=1e-9)
    assert p["ddp_samples_per_s"] == pytest.approx(64 / (32 / 80), rel=1e-9)
    assert p["standalone_sum_samples_per_s"] == pytest.approx(200)
    assert 0.95 < p["efficiency"] <= 1.0 and p["ddp_efficiency"] == pytest.approx(0.8)
    assert f"share {plan.shares[0]}/64" in plan.devices[0].reasons[0]


def test_memory_splits_a_share_into_micro_batches_and_says_why():
    small = _profile("small", 0.01, memory=400 * MIB)       # (360 − 100) / 10 -> 26 per micro-batch
    plan = make_plan([_profile("big", 0.01), small], options(120, link=FREE_LINK))
    d = plan.devices[1]
    assert d.share == 60 and d.micro_batch == 26 and d.n_micro == 3 and d.micro_sizes() == (20, 20, 20)
    assert "400.0 MiB memory" in d.reasons[1] and "x3" in d.reasons[1]


def test_a_device_that_needs_checkpointing_gets_it_or_is_left_out_with_the_fix():
    tight = replace(_profile("tight", 0.01, memory=115 * MIB), checkpoint_fraction=0.25)   # 103.5 usable
    roomy = _profile("roomy", 0.01)
    plan = make_plan([roomy, tight], options(16, link=FREE_LINK))
    assert plan.devices[1].checkpointing and plan.devices[1].micro_batch == 1
    assert "checkpointing on" in " ".join(plan.devices[1].reasons)
    no_ckpt = make_plan([roomy, tight], options(16, link=FREE_LINK, allow_checkpointing=False))
    (left,) = no_ckpt.excluded
    assert left.kind == "memory" and "does not fit one sample" in left.reason
    assert "checkpointing would need" in left.fix and "(fits)" in left.fix
    with pytest.raises(UsageError, match="one sample needs"):
        make_plan([roomy, tight], options(16, allow_checkpointing=False, allow_exclusion=False))


def test_a_model_that_fits_nowhere_explains_with_the_largest_device():
    devices = [_profile("a", 0.01, memory=50 * MIB), _profile("b", 0.01, memory=80 * MIB)]
    with pytest.raises(UsageError, match="fits on no device, not even the largest: b") as e:
        make_plan(devices, options(8))
    assert "model state alone" in e.value.fix and "FSDP" in e.value.fix


def test_a_device_too_slow_to_help_is_left_out_or_flagged():
    fast, snail = _profile("fast", 0.001, opt=0.001), _profile("snail", 1.0, opt=0.001)
    plan = make_plan([fast, snail], options(32, link=Link(bandwidth_gbs=1.0), grad_bytes=1e8))
    assert [d.device for d in plan.devices] == ["fast"] and plan.excluded[0].kind == "slow"
    assert "too slow to help" in plan.excluded[0].reason and "speed" in plan.excluded[0].fix
    kept = make_plan([fast, snail], options(32, link=Link(bandwidth_gbs=1.0), grad_bytes=1e8,
                                            allow_exclusion=False))
    assert kept.shares == (31, 1)
    assert "relaunch without it" in kept.devices[1].reasons[-1]


def test_plan_json_round_trip_keeps_predictions_and_exclusions():
    fast, snail = _profile("fast", 0.001, opt=0.001), _profile("snail", 1.0, opt=0.001)
    plan = make_plan([fast, _profile("mid", 0.002), snail], options(32, link=Link(bandwidth_gbs=1.0), grad_bytes=1e7))
    assert plan.excluded
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.predicted == plan.predicted and again.excluded == plan.excluded


def test_bad_input_is_a_usage_error_with_a_fix():
    d = _profile("d", 0.01)
    for bad in (dict(global_batch=0), dict(global_batch=-3), dict(global_batch=8, memory_margin=1.0),
                dict(global_batch=8, micro_batch_cap=0), dict(global_batch=8, grad_bytes=-1.0)):
        with pytest.raises(UsageError) as e:
            make_plan([d], PlanOptions(**bad))
        assert e.value.fix
    with pytest.raises(UsageError, match="no devices"):
        make_plan([], options(8))
    with pytest.raises(UsageError, match="global batch 2 is smaller than the 3 devices"):
        make_plan([d, d, d], options(2))


def _random_cluster(n, seed=0):
    rng = random.Random(seed)
    return [DeviceProfile(device=f"d{i}", source="synthetic", overhead_s=rng.uniform(0, 0.01),
                          per_sample_s=rng.uniform(0.001, 0.1), optimizer_s=rng.uniform(0, 0.05),
                          fixed_bytes=10**9, activation_bytes_per_sample=rng.uniform(1e6, 1e9),
                          memory_bytes=rng.choice([16, 24, 40, 80]) * 2**30) for i in range(n)]


@pytest.mark.parametrize("n, limit", [(64, 1.0), (1024, 10.0)])
def test_planner_time(n, limit):
    profiles = _random_cluster(n)
    for exclude in (True, False):
        t0 = time.process_time()        # CPU time: the machine is shared, wall time is noise
        plan = make_plan(profiles, options(8 * n, grad_bytes=4e8, link=Link(bandwidth_gbs=24),
                                           allow_exclusion=exclude))
        assert time.process_time() - t0 < limit
        assert sum(plan.shares) == 8 * n


def test_predicted_step_matches_the_cost_model():
    profiles = _random_cluster(5, seed=3)
    o = options(200, grad_bytes=1e8, link=Link(bandwidth_gbs=10))
    plan = make_plan(profiles, o)
    by_name = {p.device: p for p in profiles}
    again = step_cost([Assignment(profile=by_name[d.device], share=d.share, micro_batch=d.micro_batch,
                                  checkpointing=d.checkpointing) for d in plan.devices],
                      global_batch=200, grad_bytes=1e8, link=Link(bandwidth_gbs=10))
    assert again.step_s == pytest.approx(plan.predicted["step_s"])
