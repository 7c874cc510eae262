"""Online rebalancing: new shares from measured step times, the same decision on every rank.

Every step each rank sends (through the step's one small all-reduce, runtime/ranks/agree.py) its busy
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
    consecutive steps, so neither one noisy window nor a half-updated estimate moves shares; of
    `window` (default 8) consecutive steps when the predicted gain is under 3× the threshold
    (on the 2-core host here one rank ran 30-40% slower for 5-50 steps at a time, at unchanged
    shares, and each such burst predicted a gain of 8-17%),
  * and at least `cooldown` steps (default 4) have passed since the last change: no flip-flop.

After a change every window starts afresh: the next proposal, a move back included, rests only on
steps measured at the new shares. A time model is never exact (a device's time per sample can
differ at 41 samples from what 38 predicted), and timings from before the move, mixed into the
median, made shares swing back and forth (38/26 -> 41/23 -> 36/28 -> 39/25 on a quiet host).

A move must pay off, measured. The per-sample model that proposes a move is fitted at the shares in
force, and a device's time per sample can depend on the split itself: in the demo, whichever
CPU-played device had the longer share measured slower per sample (the A100 5.0-5.6 ms/sample at
40-41 samples, 4.0-4.3 at 36-39; likely the last rank computing while both ranks' gradient
all-reduces take CPU, not confirmed), so each split made the other look better and shares swung
11 times in 300 steps on a noisy host. So every move is a trial: once `min_samples + 2`
steps ran at the new shares, the step measured there is compared with the step measured before
the move. Not in seconds: the two windows ran tens of seconds apart, and a shared host's speed
drifts by more than the gain being judged. The figure is the step's imbalance, the slowest
rank's busy + fixed time over the ranks' mean (the median over the window, from the agreed table,
so every rank judges alike): the total work of a step is the same at any split and a drift of
the host's speed scales every rank alike, so the step time at the split is proportional to it
while the drift cancels (trial.py, shared with resplit.py). Lower by at least `threshold / 2`: kept,
and the rebalancer goes on. Higher by more than that: the shares go back. Either way short of a
gain, it then holds: no further move until some rank's speed changes at unchanged shares (the `jump` test
below), which a split-dependent bias cannot fake and a real slowdown does at once.

A move that paid leaves the rebalancer free, with one bound: the next move stays between the
shares in force and those before the last move (a bracket, as in bisection). A biased but steady
model converges inside it (50/50 -> 65/35 -> 57/43 -> 62/38 in the unit tests); a proposal past
the far end means the figures that proposed the last move no longer hold. On this host that was
a burst of one rank 27% slower for tens of steps, under the jump test's 30%: the demo went 39/25 ->
42/22 -> 36/28 -> 40/24 in 300 steps. Such a proposal holds instead; a jump releases the bound.

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
from .trial import TrialHold, jumped


@dataclass(frozen=True, kw_only=True)
class Decision:
    plan: Plan
    message: str


class Rebalancer:
    def __init__(self, *, world_size: int, window: int = 8, threshold: float = 0.08,
                 jump: float = 0.30, min_samples: int = 3, min_gain_s: float = 0.002, confirm: int = 3,
                 cooldown: int = 4, micro_batch_cap: int | None = None):
        self.world_size = world_size
        self.micro_batch_cap = micro_batch_cap   # the user's Memory(max_micro_batch=) cap, kept under any split
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
        # the measured imbalance (slowest rank's work ÷ the mean) at these shares, the move being
        # judged (the shares before it, and the imbalance there), whether a move that did not pay holds
        self.trial = TrialHold(threshold=threshold, window=window, min_samples=min_samples,
                               back_key="shares", figure_key="step_s")
        self._came_from: list[int] | None = None   # the shares before the last move (the bracket's far end)

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
            if jumped(ps, min_samples=self.min_samples, jump=self.jump):
                del ps[:-3], fx[:-3]           # a new regime: forget the old speed
                self.trial.release()
                self._came_from = None
            del ps[:-self.window], fx[:-self.window]
        if all(b > 0 for b in busy_s):
            self.trial.measure([b + max(f, 0.0) for b, f in zip(busy_s, fixed_s)])

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
        self._since_change += 1
        if self.trial.judging:
            return self._judge(plan, t, step)
        if self.trial.holding:
            return None
        new = list(balanced_shares(plan.global_batch, t, f))
        before, after = step_time(old, t, f), step_time(new, t, f)
        gain = before / after - 1
        if new == old or gain <= self.threshold or before - after <= self.min_gain_s:
            self._streak, self._last = 0, None
            return None
        same = self._last is not None and all(abs(a - b) <= 1 for a, b in zip(new, self._last))
        self._streak = self._streak + 1 if same else 1
        self._last = new
        # A small gain needs a longer streak than a large one: a burst of host load that slows one
        # rank for a few steps predicts a gain just over the threshold, a device that really
        # halved its speed predicts tens of percent and is followed after `confirm` steps.
        needed = self.confirm if gain >= 3 * self.threshold else max(self.confirm, self.window)
        if self._streak < needed or self._since_change < self.cooldown:
            return None
        if self._came_from is not None and not _between(new, self._came_from, old):
            # Past where the last move came from: the model that proposed that move no longer
            # holds (see the module's docstring). Speeds did not jump, so hold.
            self._streak, self._last, self.trial.holding = 0, None, True
            return None
        self.trial.start(old)
        timings = ", ".join(f"{d.device} {t[d.rank] * 1e3:.2f} ms/sample + {f[d.rank] * 1e3:.0f} ms/step"
                            for d in plan.devices)
        return self._move(plan, new, t, step, f"measured {timings}; predicted step {before * 1e3:.0f} -> "
                                              f"{after * 1e3:.0f} ms (+{gain:.0%})")

    def _judge(self, plan: Plan, t: list[float], step: int) -> Decision | None:
        """The move under trial, once enough steps ran at its shares: keep it if the measured
        imbalance fell by threshold / 2, else hold (and go back if it rose by as much)."""
        judged = self.trial.judge()
        if judged is None:
            return None
        verdict, back, now, before = judged
        if verdict != "back":
            return None           # 'keep': it paid, rebalance on as before; 'hold': stay, and hold
        return self._move(plan, back, t, step,
                          f"back: the move did not pay (slowest rank ×{now:.2f} the mean at "
                          f"{'/'.join(map(str, plan.shares))}, ×{before:.2f} before it); held "
                          f"there until a device's speed changes")

    def _move(self, plan: Plan, new: list[int], t: list[float], step: int, why: str) -> Decision:
        self._streak, self._last, self._since_change = 0, None, 0
        self._came_from = list(plan.shares)
        self.per_sample = [[] for _ in range(self.world_size)]   # evidence at the new shares only
        self.fixed = [[] for _ in range(self.world_size)]
        self.trial.restart()
        fastest = min(t)
        devices = tuple(_with_share(d, s, t[d.rank], fastest / t[d.rank], self.micro_batch_cap)
                        for d, s in zip(plan.devices, new))
        message = (f"rebalanced at step {step} (plan v{plan.version} -> v{plan.version + 1}): shares "
                   f"{'/'.join(map(str, plan.shares))} -> {'/'.join(map(str, new))}; {why}")
        return Decision(plan=plan.evolve(note=message, devices=devices), message=message)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"per_sample": self.per_sample, "fixed": self.fixed, "streak": self._streak,
                "last": self._last, "since_change": self._since_change, "steps": self.trial.figures,
                "trial": self.trial.pending, "holding": self.trial.holding, "came_from": self._came_from}

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly where it was (same world size), so a resumed run rebalances at the same
        step as an uninterrupted one; on another world size, measure afresh."""
        if len(state["per_sample"]) == self.world_size:
            self.per_sample = [list(v) for v in state["per_sample"]]
            self.fixed = [list(v) for v in state["fixed"]]
            self._streak, self._last, self._since_change = state["streak"], state["last"], state["since_change"]
            self.trial.figures = list(state.get("steps", []))   # checkpoints from before trials: no trial
            self.trial.pending, self.trial.holding = state.get("trial"), state.get("holding", False)
            self._came_from = state.get("came_from")


class FirstSteps(Rebalancer):
    """Over a plan that was not measured (hetrain could not call the model before training:
    runtime/measure/model_call.py), its shares are a guess from the catalog. The first proposal,
    once every rank has `min_samples` steps of device times, is taken at once if it gains more
    than the threshold: no streak and no trial (there is no measured plan to go back to). Then as
    Rebalancer."""

    replanned = False

    def propose(self, plan: Plan, *, step: int) -> Decision | None:
        if self.replanned:
            return super().propose(plan, step=step)
        est = self.estimates()
        if est is None or plan.world_size != self.world_size:
            return None
        self.replanned = True
        t, f = est
        new = list(balanced_shares(plan.global_batch, t, f))
        if step_time(list(plan.shares), t, f) / step_time(new, t, f) - 1 <= self.threshold:
            return None           # the catalog's guess was as good (within the threshold)
        timings = ", ".join(f"{d.device} {t[d.rank] * 1e3:.2f} ms/sample" for d in plan.devices)
        return self._move(plan, new, t, step, f"re-planned from the first {self.min_samples} steps (the model "
                                              f"was not measured before training): {timings}")

    def state_dict(self) -> dict:
        return {**super().state_dict(), "replanned": self.replanned}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.replanned = state.get("replanned", False)


def _between(new: list[int], a: list[int], b: list[int]) -> bool:
    """Every device's new share within [a, b] (either order), give or take one sample of rounding."""
    return all(min(x, y) - 1 <= n <= max(x, y) + 1 for n, x, y in zip(new, a, b))


def _with_share(d: DevicePlan, share: int, per_sample: float, speed: float, cap: int | None) -> DevicePlan:
    limits = [share] + [c for c in (d.max_micro_batch, cap) if c is not None]
    micro = max(1, min(limits))
    fixed_mb = d.fixed_s / d.per_sample_s * per_sample if d.per_sample_s and d.fixed_s is not None else None
    reasons = (f"share {share}: measured {per_sample * 1e3:.3g} ms/sample"
               + (f" + {fixed_mb * 1e3:.3g} ms per micro-batch" if fixed_mb is not None else "")
               + " (rebalanced)",) + d.reasons[1:]
    return replace(d, share=share, micro_batch=micro, speed=speed, per_sample_s=per_sample, fixed_s=fixed_mb,
                   reasons=reasons)
