"""The one share solver: the planner's, the rebalancer's and the speed-proportional splits are
special cases of it. Worked values, small enough to check by hand."""

from __future__ import annotations

import pytest

from hetrain.planning.shares import StepTime, balanced_shares, proportional_shares, solve_shares, step_time


def test_a_step_time_counts_its_micro_batches():
    t = StepTime(per_sample=1.0, per_micro=2.0, micro=4, fixed=0.5)
    assert [t.seconds(s) for s in (0, 1, 4, 5, 8)] == [0.0, 3.5, 6.5, 9.5, 12.5]
    assert t.share_within(9.4, 100) == 4 and t.share_within(9.5, 100) == 5
    assert t.share_within(3.4, 100) == 0 and t.share_within(1e9, 3) == 3
    assert StepTime(per_sample=0.5).share_within(2.0, 100) == 4          # one micro-batch, no cost


def test_equal_speeds_split_evenly_and_ties_go_to_the_lower_rank():
    same = [StepTime(per_sample=0.01)] * 3
    assert solve_shares(12, same) == (4, 4, 4)
    assert solve_shares(10, same) == (4, 3, 3)
    assert proportional_shares(7, [2.0, 2.0]) == (4, 3)
    # Two fast and two very slow devices: the slow ones keep their one sample each, the fast
    # split the rest, the extra sample to the lower rank.
    assert proportional_shares(11, [1.0, 1.0, 0.01, 0.01]) == (5, 4, 1, 1)


def test_speeds_split_in_proportion():
    # 0.01 s and 0.03 s per sample: 75 and 25 samples both end at 0.75 s
    assert solve_shares(100, [StepTime(per_sample=0.01), StepTime(per_sample=0.03)]) == (75, 25)
    assert proportional_shares(100, [3.0, 1.0]) == (75, 25)


def test_fixed_costs_shift_samples_to_the_device_without_them():
    # 10 ms a sample each; device 0 also spends 200 ms a step on something else:
    # 0.2 + 0.01·40 = 0.01·60, so 40/60
    times = [StepTime(per_sample=0.01, fixed=0.2), StepTime(per_sample=0.01)]
    assert solve_shares(100, times) == (40, 60)
    assert balanced_shares(100, [0.01, 0.01], [0.2, 0.0]) == (40, 60)
    assert step_time((40, 60), [0.01, 0.01], [0.2, 0.0]) == pytest.approx(0.6)


def test_a_memory_cap_on_the_micro_batch_costs_a_device_samples():
    # 1 s a sample and 2 s a micro-batch. Uncapped, both devices run one micro-batch: 12/12
    # (2 + 12 = 14 s). Memory caps device 0 at micro-batches of 4: 10 samples take 3 of them,
    # 2·3 + 10 = 16 s, as long as device 1's 2 + 14; 11 would take 17 s.
    free = StepTime(per_sample=1.0, per_micro=2.0)
    capped = StepTime(per_sample=1.0, per_micro=2.0, micro=4)
    assert solve_shares(24, [free, free]) == (12, 12)
    assert solve_shares(24, [capped, free]) == (10, 14)
    assert max(capped.seconds(10), free.seconds(14)) == 16.0


def test_a_device_too_slow_to_help_is_left_out_only_when_allowed():
    fast, snail = StepTime(per_sample=1.0), StepTime(per_sample=100.0)
    assert solve_shares(10, [fast, snail], minimum=0) == (10, 0)      # its first sample would end at 100 s
    assert solve_shares(10, [fast, snail]) == (9, 1)                  # minimum 1: it must take one
    assert solve_shares(2, [fast, fast, fast]) is None and solve_shares(4, []) is None
    assert solve_shares(2, [fast, fast, fast], minimum=0) == (1, 1, 0)

