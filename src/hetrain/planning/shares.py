"""Integer shares of a global batch: the one share solver (pure; no torch).

Device r takes T_r(s) seconds for a share of s samples (`StepTime`), 0 for none and otherwise

    T_r(s) = fixed_r + ⌈s / m_r⌉ · per_micro_r + s · per_sample_r       (m_r: largest micro-batch)

— the planner's devices (micro-batches of at most m_r, a fixed cost each), the rebalancer's
measured ones (fixed + s·t) and devices known only by a speed v (s · 1/v) are all of this form.
`solve_shares` finds the integer shares that sum to the batch B, each at least `minimum` (1:
every device takes part; 0: a device may be left out), minimising the step, max_r T_r(s_r).

Why it is exact: the k-th sample on device r ends at T_r(k), non-decreasing in k, so a split
ends when its latest sample does, and the B samples that end soonest over all devices (each
device's first `minimum` taken regardless) make the best split. Ties go to the lower device
index, so the answer is one split, whichever way it is reached.

How: a water level T at which the devices can together take the batch, Σ_r max(minimum,
cap_r(T)) ≥ B with cap_r(T) = max{s : T_r(s) ≤ T} (a closed form), by bisection down towards the
smallest such T; then, from those caps, one sample at a time with a heap, back from whoever
finishes last until the shares sum to B (ties: the higher index gives back first). The caps hold
every sample ending by T, so any such level gives the same answer; a lower one, fewer steps.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError

_BISECTIONS = 200


@dataclass(frozen=True)
class StepTime:
    """One device's seconds for a share: fixed + ⌈s / micro⌉ · per_micro + s · per_sample
    (micro None: one micro-batch, whatever the share), 0 for no share."""

    per_sample: float             # seconds per sample, > 0
    per_micro: float = 0.0        # seconds per micro-batch, whatever its size
    micro: int | None = None      # the largest micro-batch
    fixed: float = 0.0            # seconds per step whatever the share (the optimizer step, say)
    limit: int | None = None      # the largest share it may take (a gathered-state rank that must not accumulate)

    def seconds(self, share: int) -> float:
        if share <= 0:
            return 0.0
        if self.limit is not None and share > self.limit:
            return math.inf
        n_micro = 1 if self.micro is None else -(-share // self.micro)
        return self.fixed + n_micro * self.per_micro + self.per_sample * share

    def share_within(self, seconds: float, limit: int) -> int:
        """The largest share, at most `limit`, finished within `seconds` (0 if not even one)."""
        rest, one = seconds - self.fixed, self.per_micro + self.per_sample
        if rest < one:
            s = 0
        elif self.micro is None:
            s = int((rest - self.per_micro) // self.per_sample)
        else:
            full = self.per_micro + self.per_sample * self.micro
            k = int(rest // full)
            left = rest - k * full
            extra = int((left - self.per_micro) // self.per_sample) if left >= one else 0
            s = k * self.micro + min(max(extra, 0), self.micro - 1)
        s = min(limit, s, self.limit if self.limit is not None else limit)
        limit = min(limit, self.limit) if self.limit is not None else limit
        # The closed form rounds otherwise than `seconds`: settle on what `seconds` says, so
        # that every device's cap counts exactly the samples ending by then.
        while s > 0 and self.seconds(s) > seconds:
            s -= 1
        while s < limit and self.seconds(s + 1) <= seconds:
            s += 1
        return s


def solve_shares(batch: int, times: Sequence[StepTime], *, minimum: int = 1) -> tuple[int, ...] | None:
    """Integer shares summing to `batch`, each >= `minimum`, minimising max_r times[r].seconds(share_r);
    None when there is no device or `batch` < minimum × devices. See the module docstring."""
    n = len(times)
    if n == 0 or batch < n * minimum:
        return None
    # Equal devices have equal caps: each kind (equal StepTimes) is counted once, times how many,
    # so a level costs K caps for K kinds, not one per device. The sums are the same integers.
    first: dict[int, StepTime] = {}
    for t in times:
        first.setdefault(id(t), t)
    kind_index: dict[StepTime, int] = {}
    by_id = {i: kind_index.setdefault(t, len(kind_index)) for i, t in first.items()}
    kinds = list(kind_index)
    kind_of = [by_id[id(t)] for t in times]
    sizes = [0] * len(kinds)
    for k in kind_of:
        sizes[k] += 1

    def count(level: float) -> int:
        return sum(c * max(minimum, t.share_within(level, batch)) for t, c in zip(kinds, sizes))

    # Below lo not every device can take its minimum (with minimum 0: no device one sample).
    lo = max(t.seconds(minimum) for t in kinds) if minimum else min(t.seconds(1) for t in kinds)
    # At hi the device quickest at the whole batch takes all of it, so count(hi) >= batch.
    hi = max(lo, min(t.seconds(batch) for t in kinds))
    if not math.isfinite(hi):       # every kind has a share limit: all at their limits, if they add up to it
        if sum(c * max(minimum, t.limit) for t, c in zip(kinds, sizes)) < batch:
            return None
        hi = max(lo, max(t.seconds(t.limit) for t in kinds))
    over = count(lo) - batch
    if over >= 0:
        hi = lo
    else:
        over = count(hi) - batch
        for _ in range(_BISECTIONS):
            # Any level with count >= batch gives the same answer: stop once few are over.
            if over <= len(kinds) or hi - lo <= 1e-13 * hi:
                break
            mid = (lo + hi) / 2
            c = count(mid) - batch
            if c >= 0:
                hi, over = mid, c
            else:
                lo = mid
    caps = [max(minimum, t.share_within(hi, batch)) for t in kinds]
    shares = [caps[k] for k in kind_of]
    # Back from whoever finishes last; ties: the higher index first (the lower keeps its sample).
    # The devices of one kind start equal, so they give back highest index first: the kind
    # stands in the heap as its highest device not yet popped, the next one pushed as it pops.
    members: list[list[int]] = [[] for _ in kinds]
    for r, k in enumerate(kind_of):
        members[k].append(r)
    heap = [(-kinds[k].seconds(caps[k]), -members[k][-1], k, len(members[k]) - 1)
            for k in range(len(kinds)) if caps[k] > minimum]
    heapq.heapify(heap)
    for _ in range(sum(shares) - batch):
        t, r, k, at = heapq.heappop(heap)
        if at > 0:      # the kind's next device, still at its cap
            heapq.heappush(heap, (t, -members[k][at - 1], k, at - 1))
        r = -r
        shares[r] -= 1
        if shares[r] > minimum:
            heapq.heappush(heap, (-times[r].seconds(shares[r]), -r, -1, 0))
    return tuple(shares)


def proportional_shares(global_batch: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """Integer shares summing to `global_batch`, each >= 1, minimising max(share / speed) (v_r:
    samples/s of device r): `solve_shares` with T_r(s) = s · 1/v_r. Every device gets at least
    one sample (a device too slow to help is the planner's call to exclude, not this function's)."""
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
    times = {s: StepTime(per_sample=1 / s) for s in set(speeds)}      # one per distinct speed
    return solve_shares(global_batch, [times[s] for s in speeds])


def _linear(per_sample_s: Sequence[float], fixed_s: Sequence[float] | None) -> list[StepTime]:
    fixed = list(fixed_s) if fixed_s is not None else [0.0] * len(per_sample_s)
    return [StepTime(per_sample=t, fixed=f) for t, f in zip(per_sample_s, fixed)]


def balanced_shares(global_batch: int, per_sample_s: Sequence[float],
                    fixed_s: Sequence[float] | None = None) -> tuple[int, ...]:
    """Integer shares (sum = global_batch, each >= 1) minimising max_r(fixed_r + share_r · t_r):
    `solve_shares` with measured times. t_r is a device's seconds per sample, fixed_r its seconds
    per step that do not scale with the share (the optimizer step, say), which a slow device also
    runs slower."""
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
    return solve_shares(global_batch, _linear(per_sample_s, fixed))


def step_time(shares: Sequence[int], per_sample_s: Sequence[float], fixed_s: Sequence[float] | None = None) -> float:
    """Predicted step time of a split: the slowest device's fixed + share · per-sample time (a
    device with no share: 0)."""
    return max(t.seconds(s) for t, s in zip(_linear(per_sample_s, fixed_s), shares))
