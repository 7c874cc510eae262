"""What pacing costs an emulated device: the CPU a pass takes when the emulator paces it as
training does, over a flat-out one's (the profile's `paced_cost`; profiling.py
measures it, planning/cost.py charges it on a step's last micro-batch).

On the CPU's own clock an emulated device's time is its thread's CPU time over its speed, and its
throttle sleeps before the backward of a step's last micro-batch (emulation/device.Throttle). A
backward after that sleep runs on caches and a core that went to other work, and costs more CPU
than the profiler's back-to-back passes: 1.4-4% more on a 2-core AMD EPYC
(measured inside training runs). Each paced pass is timed beside a flat-out one, under a second
apart, so the host's drift (10-40% within seconds on such a host) cancels in the ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ..runtime.devices import clock as clocks
from ..runtime.user_objects import as_scalar

PACED_PAIRS = 9                # paced passes timed, each beside a flat-out one (the first pair dropped)
PACED_PASS_S = 0.05            # ... at the largest timed size whose flat-out pass takes at most this
PACED_CPU_S = 2.5              # ... stopping (after MIN_PAIRS) once the passes took this much CPU: on an
MIN_PAIRS = 3                  # AVX2-only host an explicit bf16 computes ~40x slower, and even size 1 is
                               # far above PACED_PASS_S (here 9 pairs at 50 ms take about 1.4 s)


def timed_pass(model: torch.nn.Module, batch, fwd: Callable, throttle=None, *, samples: int = 1) -> tuple[float, float]:
    """One forward and backward of `batch`, flat out, or paced through `throttle` as training paces
    a step's last micro-batch (its forward, the sleep: emulation/device.Throttle.before_backward,
    its backward, the guess's error settled). Returns this thread's CPU seconds of the forward and
    of the backward; gradients are dropped."""
    c0 = clocks.thread_cpu()
    loss = as_scalar(fwd(model, batch))
    forward = clocks.thread_cpu() - c0
    guess = throttle.before_backward(forward, samples=samples) if throttle is not None else 0.0
    c1 = clocks.thread_cpu()
    loss.backward()
    backward = clocks.thread_cpu() - c1
    if throttle is not None:
        throttle.after_backward(forward, guess, backward)
        throttle.settle()
    model.zero_grad(set_to_none=True)
    return forward, backward


def paced_cost(model: torch.nn.Module, batch, fwd: Callable, throttle, *, pairs: int = PACED_PAIRS,
               cpu_budget_s: float = PACED_CPU_S) -> float:
    """The CPU a pass of `batch` takes paced as training paces it over a flat-out one's
    (`timed_pass`): the median ratio of `pairs` passes of each, alternated (under a second apart:
    the host's drift cancels), the first pair dropped; fewer (MIN_PAIRS at least) once the passes
    have taken `cpu_budget_s` of CPU. At least 1 (pacing saves no CPU: a ratio under 1 is noise);
    at most 2."""
    ratios, spent = [], 0.0
    for k in range(pairs + 1):
        warm = sum(timed_pass(model, batch, fwd))
        flat = sum(timed_pass(model, batch, fwd))     # hot: after a pass, not after the paced one's sleep
        paced = sum(timed_pass(model, batch, fwd, throttle))
        spent += warm + flat + paced
        if k:
            ratios.append(paced / max(flat, 1e-9))
        if len(ratios) >= MIN_PAIRS and spent >= cpu_budget_s:
            break
    return min(2.0, max(1.0, statistics.median(ratios)))
