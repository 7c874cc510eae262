from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.planning.plan import DevicePlan, Plan, split_evenly
from hetrain.planning.shares import proportional_shares


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 5000), speeds=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=12))
def test_shares_are_integers_summing_to_the_batch_at_least_one_each(batch, speeds):
    if batch < len(speeds):
        with pytest.raises(UsageError):
            proportional_shares(batch, speeds)
        return
    shares = proportional_shares(batch, speeds)
    assert sum(shares) == batch and min(shares) >= 1 and len(shares) == len(speeds)


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 400), speeds=st.lists(st.floats(0.05, 5.0), min_size=1, max_size=5))
def test_shares_minimise_the_step_time(batch, speeds):
    """No single sample moved between two devices shortens max(share / speed)."""
    if batch < len(speeds):
        return
    shares = list(proportional_shares(batch, speeds))
    best = max(s / v for s, v in zip(shares, speeds))
    for a in range(len(shares)):
        for b in range(len(shares)):
            if a != b and shares[a] > 1:
                moved = shares.copy()
                moved[a] -= 1
                moved[b] += 1
                assert max(s / v for s, v in zip(moved, speeds)) >= best - 1e-12


def test_seed_ratio_split():
    assert proportional_shares(64, [1.0, 0.67]) == (38, 26)
    assert proportional_shares(32, [1.0, 1.0]) == (16, 16)


def test_bad_speeds_and_batches():
    with pytest.raises(UsageError, match="smaller than the 3 devices"):
        proportional_shares(2, [1, 1, 1])
    with pytest.raises(UsageError, match="positive"):
        proportional_shares(8, [1, 0])
    with pytest.raises(UsageError, match="no devices"):
        proportional_shares(8, [])


def test_split_evenly():
    assert split_evenly(19, 3) == (7, 6, 6)
    assert split_evenly(8, 8) == (1,) * 8
    with pytest.raises(ValueError):
        split_evenly(2, 3)


def test_plan_json_round_trip_and_validation():
    plan = Plan(global_batch=10, devices=tuple(
        DevicePlan(rank=r, device="x", speed=1, share=5, micro_batch=4, max_micro_batch=4,
                   reasons=("why",)) for r in range(2)))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    newer = plan.evolve(note="test")
    assert newer.version == plan.version + 1
    with pytest.raises(ValueError, match="sum to"):
        Plan(global_batch=5, devices=(DevicePlan(rank=0, device="x", speed=1, share=4, micro_batch=4),))
    bad = json.loads(plan.to_json())
    bad["schema"] = 99
    with pytest.raises(ValueError, match="schema"):
        Plan.from_json(json.dumps(bad))


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 300), data=st.data())
def test_balanced_shares_are_optimal_with_fixed_costs(batch, data):
    from hetrain.planning.shares import balanced_shares, step_time

    n = data.draw(st.integers(1, 4))
    if batch < n:
        return
    t = data.draw(st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n))
    f = data.draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n))
    shares = list(balanced_shares(batch, t, f))
    assert sum(shares) == batch and min(shares) >= 1
    best = step_time(shares, t, f)
    for a in range(n):
        for b in range(n):
            if a != b and shares[a] > 1:
                moved = shares.copy()
                moved[a] -= 1
                moved[b] += 1
                assert step_time(moved, t, f) >= best - 1e-9


def test_balanced_shares_without_fixed_costs_match_proportional():
    from hetrain.planning.shares import balanced_shares

    assert balanced_shares(64, [1 / 1.0, 1 / 0.67]) == proportional_shares(64, [1.0, 0.67])
