"""Online rebalancing: new shares from measured step times, the same decision on every rank.

Every step each rank reports (through the step's one small all-reduce, runtime/ranks/agree.py) its busy
time in the micro-batches — compute only, never time spent waiting for peers — and the busy time
of the rest of its step (optimizer). A device's micro-batch time is k_r · (α_r + b_r): α_r is the
fixed overhead in sample-equivalents, from the time model measured before training (the model's
shape, which a speed change does not alter), and k_r the seconds per sample now. From the same
windows of k_r every rank computes the same proposal: the split minimising
max_r(f_r + b_r · k_r), f_r = α_r · k_r + the rest of the step (planning.shares.balanced_shares).
The Plan changes only when

  * every rank has at least `min_samples` measurements since the last change of its speed, and
  * the predicted step time improves by more than `threshold` (default 8%) and by more than
    `min_gain_s` (default 2 ms: below that, a small model's step is dominated by jitter),
  * the same proposal (within one sample per device) comes out of `confirm` (default 3)
    consecutive steps, so neither one noisy window nor a half-updated estimate moves shares,
  * and at least `cooldown` steps (default 4) have passed since the last change: no flip-flop.

After a change every window starts afresh: the next proposal, a move back included, rests only on
steps measured at the new shares. A time model is never exact (a device's time per sample can
differ at 41 samples from what 38 predicted), and timings from before the move, mixed into the
median, made shares swing back and forth (38/26 -> 41/23 -> 36/28 -> 39/25 on a quiet host).

Noise does not move shares: estimates are medians over up to `window` steps (a burst of load
from another process on a shared host moves a median less than a mean). A real change does,
quickly: when a rank's last 3 measurements all sit more than `jump` (default 30%) away from its
earlier mean, the older measurements are dropped, so the estimate moves to the new speed at once
rather than drifting there over a whole window.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from ...planning.plan import DevicePlan, Plan
from ...planning.shares import balanced_shares, step_time


@dataclass(frozen=True, kw_only=True)
class Decision:
    plan: Plan
    message: str


class Rebalancer:
    def __init__(self, *, world_size: int, window: int = 8, threshold: float = 0.08,
                 jump: float = 0.30, min_samples: int = 3, min_gain_s: float = 0.002, confirm: int = 3,
                 cooldown: int = 4, micro_batch_cap: int | None = None):
        self.world_size = world_size
        self.micro_batch_cap = micro_batch_cap   # the user's micro_batch= cap, kept under any split
        self.window = window
        self.threshold = threshold
        self.jump = jump
        self.min_samples = min_samples
        self.min_gain_s = min_gain_s
        self.confirm = confirm
        self.cooldown = cooldown
        self._streak = 0          # consecutive steps with (about) the same proposal
        self._last: list[int] | None = None
        self._since_change = cooldown
        self.per_sample: list[list[float]] = [[] for _ in range(world_size)]
        self.fixed: list[list[float]] = [[] for _ in range(world_size)]
        self.alpha = [0.0] * world_size

    # -- measurements -------------------------------------------------------------------------
    @staticmethod
    def overhead(d: DevicePlan) -> float:
        """α: the device's fixed time per step — its micro-batches' fixed costs — in samples'
        worth (0 when not measured). Follows the micro-batch count of the plan in force."""
        return d.fixed_s * d.n_micro / d.per_sample_s if d.per_sample_s and d.fixed_s is not None else 0.0

    def observe(self, plan: Plan, *, busy_s: list[float], fixed_s: list[float]) -> None:
        """One step's figures, measured under `plan`."""
        self.alpha = [self.overhead(d) for d in plan.devices]
        for r in range(self.world_size):
            samples = plan.devices[r].share
            if busy_s[r] <= 0:
                continue
            ps, fx = self.per_sample[r], self.fixed[r]
            ps.append(busy_s[r] / (self.alpha[r] + samples))
            fx.append(max(fixed_s[r], 0.0))
            if len(ps) >= self.min_samples + 3:
                recent, earlier = ps[-3:], ps[:-3]
                base = sum(earlier) / len(earlier)
                if all(v > base * (1 + self.jump) for v in recent) or all(v < base / (1 + self.jump) for v in recent):
                    del ps[:-3], fx[:-3]           # a new regime: forget the old speed
            del ps[:-self.window], fx[:-self.window]

    def estimates(self) -> tuple[list[float], list[float]] | None:
        """Seconds per sample and fixed seconds per step, per rank; None until enough data."""
        if any(len(ps) < self.min_samples for ps in self.per_sample):
            return None
        t = [statistics.median(ps) for ps in self.per_sample]
        f = [statistics.median(fx) + a * k for fx, a, k in zip(self.fixed, self.alpha, t)]
        return t, f

    # -- the decision -------------------------------------------------------------------------
    def propose(self, plan: Plan, *, step: int) -> Decision | None:
        est = self.estimates()
        if est is None or plan.world_size != self.world_size:
            return None
        t, f = est
        old = list(plan.shares)
        new = list(balanced_shares(plan.global_batch, t, f))
        before, after = step_time(old, t, f), step_time(new, t, f)
        gain = before / after - 1
        self._since_change += 1
        if new == old or gain <= self.threshold or before - after <= self.min_gain_s:
            self._streak, self._last = 0, None
            return None
        same = self._last is not None and all(abs(a - b) <= 1 for a, b in zip(new, self._last))
        self._streak = self._streak + 1 if same else 1
        self._last = new
        if self._streak < self.confirm or self._since_change < self.cooldown:
            return None
        self._streak, self._last, self._since_change = 0, None, 0
        self.per_sample = [[] for _ in range(self.world_size)]   # evidence at the new shares only
        self.fixed = [[] for _ in range(self.world_size)]
        fastest = min(t)
        devices = tuple(_with_share(d, s, t[d.rank], fastest / t[d.rank], self.micro_batch_cap)
                        for d, s in zip(plan.devices, new))
        timings = ", ".join(f"{d.device} {t[d.rank] * 1e3:.2f} ms/sample + {f[d.rank] * 1e3:.0f} ms/step"
                            for d in plan.devices)
        message = (f"rebalanced at step {step} (plan v{plan.version} -> v{plan.version + 1}): shares "
                   f"{'/'.join(map(str, old))} -> {'/'.join(map(str, new))}; measured {timings}; "
                   f"predicted step {before * 1e3:.0f} -> {after * 1e3:.0f} ms (+{gain:.0%})")
        return Decision(plan=plan.evolve(note=message, devices=devices), message=message)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"per_sample": self.per_sample, "fixed": self.fixed, "streak": self._streak,
                "last": self._last, "since_change": self._since_change}

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly where it was (same world size), so a resumed run rebalances at the same
        step as an uninterrupted one; on another world size, measure afresh."""
        if len(state["per_sample"]) == self.world_size:
            self.per_sample = [list(v) for v in state["per_sample"]]
            self.fixed = [list(v) for v in state["fixed"]]
            self._streak, self._last, self._since_change = state["streak"], state["last"], state["since_change"]


def _with_share(d: DevicePlan, share: int, per_sample: float, speed: float, cap: int | None) -> DevicePlan:
    limits = [share] + [c for c in (d.max_micro_batch, cap) if c is not None]
    micro = max(1, min(limits))
    fixed_mb = d.fixed_s / d.per_sample_s * per_sample if d.per_sample_s and d.fixed_s is not None else None
    reasons = (f"share {share}: measured {per_sample * 1e3:.3g} ms/sample"
               + (f" + {fixed_mb * 1e3:.3g} ms per micro-batch" if fixed_mb is not None else "")
               + " (rebalanced)",) + d.reasons[1:]
    return replace(d, share=share, micro_batch=micro, speed=speed, per_sample_s=per_sample, fixed_s=fixed_mb,
                   reasons=reasons)
