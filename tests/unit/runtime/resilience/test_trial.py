"""The trial/hold helper both rebalancers share (runtime/resilience/trial.py), against figures
worked out by hand."""

import pytest

from hetrain.runtime.resilience.trial import TrialHold, jumped, trial_verdict


def test_a_move_is_kept_sent_back_or_held_by_half_the_threshold():
    assert trial_verdict(0.95, 1.0, 0.08) == "keep"       # fell by more than 4%
    assert trial_verdict(0.97, 1.0, 0.08) == "hold"
    assert trial_verdict(1.03, 1.0, 0.08) == "hold"
    assert trial_verdict(1.05, 1.0, 0.08) == "back"       # rose by more than 4%


def test_a_jump_is_three_measurements_all_past_the_earlier_mean():
    base = [1.0, 1.0, 1.0]
    assert jumped(base + [1.4, 1.5, 1.35], min_samples=3, jump=0.3)
    assert jumped(base + [0.7, 0.6, 0.75], min_samples=3, jump=0.3)       # faster: 1 / 1.3 = 0.77
    assert not jumped(base + [1.4, 1.2, 1.5], min_samples=3, jump=0.3)    # one of the three is not
    assert not jumped([1.0, 1.0, 1.5, 1.5, 1.5], min_samples=3, jump=0.3)  # too few before them


def test_a_move_is_judged_on_figures_measured_after_it_and_holds_short_of_a_gain():
    t = TrialHold(threshold=0.08, window=8, min_samples=3, back_key="shares", figure_key="step_s")
    t.measure([3.0, 1.0])                      # slowest 3 against a mean of 2
    assert t.figures == [1.5]
    t.start([40, 24])
    assert not t.judging                       # one figure before the move: nothing to judge against
    t.measure([3.0, 1.0])
    t.measure([2.0, 2.0])                      # median of 1.5, 1.5, 1.0
    t.start([40, 24])
    assert t.pending == {"shares": [40, 24], "step_s": 1.5}
    t.restart()                                # the move is made: figures at the new shares only
    for _ in range(4):
        t.measure([1.65, 1.35])                # 1.1: a 27% lower imbalance
        assert t.judge() is None               # min_samples + 2 = 5 steps needed
    t.measure([1.65, 1.35])
    verdict, back, now, before = t.judge()
    assert (verdict, back, before) == ("keep", [40, 24], 1.5) and now == pytest.approx(1.1)
    assert not t.holding and not t.judging
    t.start([41, 23])
    t.restart()
    for _ in range(5):
        t.measure([1.8, 1.2])                  # 1.2 against 1.1 before: worse
    assert t.judge()[0] == "back" and t.holding and not t.judging
    t.release()                                # a speed jumped: free to move again
    assert not t.holding and t.figures == pytest.approx([1.2] * 3)
