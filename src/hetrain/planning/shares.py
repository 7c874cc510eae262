"""Split a global batch across devices in proportion to speed (pure; no torch).

The step time of data parallelism is max_r(b_r / v_r) (v_r: samples/s of device r), so the best
integer split minimises that maximum: start from floor(B·v_r/Σv), then give each remaining sample
to the device that would finish it soonest. Every device gets at least one sample (a device too
slow to help is the planner's call to exclude, not this function's).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..errors import UsageError


def proportional_shares(global_batch: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """Integer shares summing to `global_batch`, each >= 1, minimising max(share / speed)."""
    n = len(speeds)
    if n == 0:
        raise UsageError("no devices to split the batch across", "give at least one device")
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise UsageError(f"device speeds must be positive numbers, got {list(speeds)}",
                         "check the cluster spec or the measured warm-up")
    if global_batch < n:
        raise UsageError(
            f"global batch {global_batch} is smaller than the {n} devices",
            f"use a global batch of at least {n} (every device needs one sample), or fewer devices",
        )
    total = sum(speeds)
    shares = [max(1, math.floor(global_batch * s / total)) for s in speeds]
    # Too many after the >= 1 floor: take back from whoever is slowest to finish, keeping >= 1.
    while sum(shares) > global_batch:
        r = max((r for r in range(n) if shares[r] > 1), key=lambda r: shares[r] / speeds[r])
        shares[r] -= 1
    heap = [((shares[r] + 1) / speeds[r], r) for r in range(n)]
    heapq.heapify(heap)
    for _ in range(global_batch - sum(shares)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, ((shares[r] + 1) / speeds[r], r))
    return tuple(shares)


def balanced_shares(global_batch: int, per_sample_s: Sequence[float],
                    fixed_s: Sequence[float] | None = None) -> tuple[int, ...]:
    """Integer shares (sum = global_batch, each >= 1) minimising max_r(fixed_r + share_r · t_r).

    The measured form of `proportional_shares`: t_r is a device's seconds per sample, fixed_r its
    seconds per step that do not scale with the share (the optimizer step, say), which a slow
    device also runs slower. Each remaining sample goes to the device that would finish it first.
    """
    n = len(per_sample_s)
    fixed = list(fixed_s) if fixed_s is not None else [0.0] * n
    if n == 0 or len(fixed) != n:
        raise UsageError("per-sample and fixed times must be given for every device", "check the inputs")
    if any(not (t > 0 and math.isfinite(t)) for t in per_sample_s) or any(not (f >= 0) for f in fixed):
        raise UsageError(f"device times must be positive, got {list(per_sample_s)} / {fixed}",
                         "measure at least one step on every device")
    if global_batch < n:
        raise UsageError(f"global batch {global_batch} is smaller than the {n} devices",
                         f"use a global batch of at least {n}")
    # Water level T with Σ (T - f_r)/t_r = B, then floors, then the rest one by one.
    speeds = [1 / t for t in per_sample_s]
    level = (global_batch + sum(f * v for f, v in zip(fixed, speeds))) / sum(speeds)
    shares = [max(1, math.floor((level - f) * v)) for f, v in zip(fixed, speeds)]
    while sum(shares) > global_batch:
        r = max((r for r in range(n) if shares[r] > 1), key=lambda r: fixed[r] + shares[r] * per_sample_s[r])
        shares[r] -= 1
    heap = [(fixed[r] + (shares[r] + 1) * per_sample_s[r], r) for r in range(n)]
    heapq.heapify(heap)
    for _ in range(global_batch - sum(shares)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, (fixed[r] + (shares[r] + 1) * per_sample_s[r], r))
    return tuple(shares)


def step_time(shares: Sequence[int], per_sample_s: Sequence[float], fixed_s: Sequence[float] | None = None) -> float:
    """Predicted step time of a split: the slowest device's fixed + share · per-sample time."""
    fixed = fixed_s if fixed_s is not None else [0.0] * len(shares)
    return max(f + b * t for b, t, f in zip(shares, per_sample_s, fixed))
