"""A move on trial, and the hold after one that did not pay: what rebalance.py (samples between
data-parallel ranks) and resplit.py (blocks between pipeline stages) share.

The figure judged is a step's imbalance, the busiest rank's work over the ranks' mean (median over
the window): a host whose speed drifts scales every rank alike, so the drift cancels, where two
windows' seconds tens of seconds apart would not compare. A move is put on trial when there is a
figure from before it; once `min_samples + 2` steps ran after it, trial_verdict judges it. Short of
a gain the owner holds (makes no move) until a speed jumps at an unchanged split (`jumped`), which
a split-dependent bias in the owner's model cannot fake.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def trial_verdict(now: float, before: float, threshold: float) -> str:
    """A move on trial, judged by what it was meant to lower (a step's seconds, a stage's
    imbalance): 'keep' if it fell by threshold / 2, 'back' if it rose by as much, else 'hold'."""
    if now <= before * (1 - threshold / 2):
        return "keep"
    return "hold" if now < before * (1 + threshold / 2) else "back"


def jumped(series: list[float], *, min_samples: int, jump: float) -> bool:
    """Whether a rank's last 3 measurements all sit more than `jump` away from its earlier mean
    (a real change of speed, not noise); the caller then drops the older ones."""
    if len(series) < min_samples + 3:
        return False
    recent, earlier = series[-3:], series[:-3]
    base = sum(earlier) / len(earlier)
    return all(v > base * (1 + jump) for v in recent) or all(v < base / (1 + jump) for v in recent)


class TrialHold:
    """The imbalance window, the move under trial and whether the owner holds.

    `pending` is the owner's checkpoint form, {back_key: what the move replaced, figure_key: the
    imbalance before it}, so checkpoints written before this class load unchanged."""

    def __init__(self, *, threshold: float, window: int, min_samples: int, back_key: str, figure_key: str):
        self.threshold, self.window, self.min_samples = threshold, window, min_samples
        self.back_key, self.figure_key = back_key, figure_key
        self.figures: list[float] = []       # the step's imbalance at the split in force, the last `window`
        self.pending: dict | None = None     # the move being judged
        self.holding = False                 # a move did not pay: no move until a speed jumps

    @property
    def judging(self) -> bool:
        return self.pending is not None

    def measure(self, work: Sequence[float]) -> None:
        """One step's work per rank (every one measured, > 0)."""
        self.figures.append(max(work) * len(work) / sum(work))
        del self.figures[:-self.window]

    def release(self) -> None:
        """A speed jumped: no trial, no hold, and only the figures of the new regime."""
        self.holding, self.pending = False, None
        del self.figures[:-3]

    def start(self, back: Any) -> None:
        """A move away from `back` is made: on trial, when there is a figure from before it."""
        if len(self.figures) >= self.min_samples:
            self.pending = {self.back_key: back, self.figure_key: statistics.median(self.figures)}

    def restart(self) -> None:
        """Figures at the new split only (the trial, if any, goes on)."""
        self.figures = []

    def forget(self) -> None:
        self.figures, self.pending, self.holding = [], None, False

    def judge(self) -> tuple[str, Any, float, float] | None:
        """The move under trial, once enough steps ran after it: (verdict, what to go back to, the
        figure now, the figure before); the trial is over and, short of 'keep', the owner holds.
        None while too few steps ran."""
        if len(self.figures) < self.min_samples + 2:
            return None
        trial, self.pending = self.pending, None
        now, before = statistics.median(self.figures), trial[self.figure_key]
        verdict = trial_verdict(now, before, self.threshold)
        if verdict != "keep":
            self.holding = True
        return verdict, trial[self.back_key], now, before
