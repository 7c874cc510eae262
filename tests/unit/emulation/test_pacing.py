"""emulation/pacing.py: paced_cost reads what a backward after the throttle's sleep costs
beyond a flat-out one, and nothing where the sleep costs nothing."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from hetrain.emulation.pacing import paced_cost


def spin(cpu_s: float) -> None:
    """Burn `cpu_s` seconds of this thread's CPU (the same on a busy host: CPU, not wall time)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


class ColdAfterSleep(torch.autograd.Function):
    """A layer whose backward costs 10 ms of CPU, or 15 ms right after the throttle's sleep (as a
    backward on cold caches costs more): the profiler must read the 1.5x it is not told."""
    cold = False

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        spin(0.015 if ColdAfterSleep.cold else 0.01)
        ColdAfterSleep.cold = False
        return grad


class SleepMarks:
    """A throttle whose sleep leaves the next backward cold (and never sleeps: the test times CPU)."""
    def before_backward(self, forward_cpu, *, samples=1):
        ColdAfterSleep.cold = True
        return 0.0

    def after_backward(self, forward_cpu, guess, backward_cpu):
        pass

    def settle(self):
        pass


def test_paced_cost_reads_what_a_backward_after_the_sleep_costs_beyond_a_flat_out_one():
    model = nn.Linear(4, 4)

    def fwd(m, batch):
        return ColdAfterSleep.apply(m(batch)).sum()

    cost = paced_cost(model, torch.randn(2, 4), fwd, SleepMarks(), pairs=3)
    assert cost == pytest.approx(1.5, rel=0.1)     # (forward + 15 ms) / (forward + 10 ms), forward < 1 ms
    assert all(p.grad is None for p in model.parameters())
    ColdAfterSleep.cold = False
    assert paced_cost(model, torch.randn(2, 4), fwd, type("Flat", (SleepMarks,), {
        "before_backward": lambda self, f, samples=1: 0.0})(), pairs=3) == pytest.approx(1.0, abs=0.1)


def test_paced_cost_stops_after_a_few_pairs_once_its_passes_spent_their_cpu_budget():
    """On a host where the pass is slow (bf16 on an AVX2-only CPU), the paced passes are bounded
    by their CPU, not by a count: MIN_PAIRS kept pairs (and the dropped first) once over budget."""
    from hetrain.emulation.pacing import MIN_PAIRS

    model = nn.Linear(4, 4)

    class Counting(SleepMarks):
        paced = 0

        def before_backward(self, forward_cpu, *, samples=1):
            Counting.paced += 1
            return super().before_backward(forward_cpu, samples=samples)

    def fwd(m, batch):
        return ColdAfterSleep.apply(m(batch)).sum()

    cost = paced_cost(model, torch.randn(2, 4), fwd, Counting(), pairs=9, cpu_budget_s=0.01)
    assert Counting.paced == MIN_PAIRS + 1 and cost == pytest.approx(1.5, rel=0.1)
    Counting.paced = 0
    paced_cost(model, torch.randn(2, 4), fwd, Counting(), pairs=4, cpu_budget_s=60.0)
    assert Counting.paced == 5                      # within its budget: every pair
    ColdAfterSleep.cold = False
