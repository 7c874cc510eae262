"""Online re-splitting of a pipeline (parallel='pp'): blocks move between stages when a stage's
device changes speed, the same decision on every rank.

Where rebalance.py moves samples between data-parallel ranks, this moves blocks between pipeline
stages: a stage whose device slows down (thermal limits, a shared GPU, an injected `slow`
fault) sets the whole pipeline's pace, and the split sized at the start, by speeds that no longer
hold, is then the wrong one.

The evidence is the step's agreement table, which every rank already sends (runtime/ranks/agree.py):
each stage's busy time in its forward and backward pieces (`busy_s`, any slowdown included: the time
the device is busy, never waiting for its neighbours). Every rank knows the split in force and the
agreed block costs at speed 1 (the profile the split was sized from), so every rank computes, for
every stage, the seconds its pieces would have taken at speed 1 (m micro-batches of µ rows through
its blocks: PipelineSplit's own stage time) and the stage's measured speed, that over its busy
time. No collective is added to a step. From the medians of those speeds over up to `window`
steps, the planner's own splitter (runtime/layouts/pipeline/split.split_pipeline, with its memory check
against each device's memory) proposes the best split, and every rank reaches the same proposal
from the same table. The split changes only when, as rebalance.py's shares do:

  * every stage has `min_samples` measurements since the last change of split or of its speed,
  * the proposal predicts a step shorter by more than `threshold` (the job's rebalance_threshold),
  * the same proposal came out of `confirm` consecutive steps (`window` of them when the predicted
    gain is under 3× the threshold: a burst of host load predicts a small gain, a device that
    halved its speed a large one), and `cooldown` steps passed since the last change.

A change is a trial (trial.py, as rebalance.py's moves are). Once `min_samples + 2` steps ran at the new split, the step's imbalance (the
busiest stage's busy time over the stages' mean, median over the window: a host whose speed drifts
scales every stage alike, so it cancels) is compared with the imbalance before the move: lower by
`threshold / 2`, kept; higher by as much, the blocks go back; either way short of a gain, the split
holds until a stage's speed jumps (its last 3 speeds all `jump` away from its earlier mean, which
also drops the older evidence so the estimate follows the new speed at once).

A split that would be faster but does not fit a device's memory (the splitter's memory model:
parameters, gradients and optimizer state, and the schedule's activations in flight) is not made:
the best split that fits is taken instead, if it gains, and rank 0's log says once, in one line
with every rank's numbers side by side, what was refused and why.

The move itself is a collective of the pipeline at the step boundary (layouts/pipeline/move.py,
through Pipeline.resplit): one all_gather first checks that every rank proposes the same split,
then parameters and optimizer state travel point to point. Plain pipelines only: under DP×PP every
replica must keep the same blocks on a stage (their gradients are averaged stage by stage), so its
split stays as planned.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ....errors import UsageError
from ....hardware.units import format_bytes
from .split import (PipelineProfile, PipelineSplit, StageDevice, evaluate_split,
                                        split_pipeline)
from ....planning.plan import Plan
from ...resilience.rebalance import Decision
from ...resilience.trial import TrialHold, jumped


@dataclass(frozen=True, kw_only=True)
class Sizing:
    """What the pipeline was sized from, agreed by every rank at its start."""

    profile: PipelineProfile            # the blocks' costs at speed 1 (on the controlled clock when the job has one)
    devices: tuple[StageDevice, ...]    # each stage's device: its name and memory (speeds are measured here)
    schedule: str
    state_factor: float
    memory_margin: float


class Resplitter:
    def __init__(self, *, sizing: Sizing, sizes: Sequence[int], move: Callable[[PipelineSplit, int], str | None],
                 log, threshold: float = 0.08, window: int = 8, jump: float = 0.30, min_samples: int = 3,
                 confirm: int = 3, cooldown: int = 4):
        self.sizing, self.move, self.log = sizing, move, log
        self.threshold, self.window, self.jump = threshold, window, jump
        self.min_samples, self.confirm, self.cooldown = min_samples, confirm, cooldown
        self.p = len(sizing.devices)
        self._since_change = cooldown
        # the busiest stage's busy time over the mean at this split, the move being judged (the
        # split before it, and the imbalance there), whether a move that did not pay holds
        self.trial = TrialHold(threshold=threshold, window=window, min_samples=min_samples,
                               back_key="sizes", figure_key="imbalance")
        self._fresh(tuple(sizes))

    def _fresh(self, sizes: tuple[int, ...], *, judging: bool = False) -> None:
        """Evidence at this split only (a stage's busy time depends on the blocks it runs); a move's
        trial and hold go on (`judging`), another change of split forgets them."""
        self.sizes = sizes
        self.speeds: list[list[float]] = [[] for _ in range(self.p)]
        if judging:
            self.trial.restart()
        else:
            self.trial.forget()
        self._streak, self._last = 0, None
        self._refused_streak, self._refused_last = 0, None
        self._logged = None             # the refused split rank 0's log named last

    # -- the splitter, at given speeds ------------------------------------------------------------
    def _devices(self, speeds: Sequence[float], *, memory: bool = True) -> list[StageDevice]:
        return [StageDevice(name=d.name, speed=v, memory_bytes=d.memory_bytes if memory else None)
                for d, v in zip(self.sizing.devices, speeds)]

    def _common(self, plan: Plan) -> dict:
        micro = plan.devices[0].micro_sizes()        # as the layout cuts the share (one µ per pipeline)
        sz = self.sizing
        return dict(micro_batches=len(micro), micro_batch_size=max(micro), schedule=sz.schedule,
                    state_factor=sz.state_factor, memory_margin=sz.memory_margin)

    def _evaluate(self, plan: Plan, sizes: Sequence[int], speeds: Sequence[float]) -> PipelineSplit:
        return evaluate_split(self.sizing.profile, self._devices(speeds), sizes, **self._common(plan))

    def _best(self, plan: Plan, speeds: Sequence[float], *, memory: bool) -> PipelineSplit | None:
        try:
            return split_pipeline(self.sizing.profile, self._devices(speeds, memory=memory), **self._common(plan))
        except UsageError:          # no split fits at all: nothing to move to
            return None

    # -- measurements -----------------------------------------------------------------------------
    def observe(self, plan: Plan, *, busy_s: list[float], fixed_s: list[float]) -> None:
        """One step's figures (the agreement table's busy_s, stage by stage), measured under `plan`."""
        del fixed_s       # the optimizer step's time does not depend on the split's pace
        sizes = tuple(plan.stage_blocks)
        if sizes != self.sizes:         # the split changed elsewhere (a resumed job re-planned it)
            self._fresh(sizes)
        at_one = self._evaluate(plan, sizes, [1.0] * self.p)
        m = at_one.micro_batches
        for s, busy in enumerate(busy_s):
            if busy <= 0:
                continue
            series = self.speeds[s]
            series.append(m * at_one.stages[s].seconds_per_micro / busy)
            if jumped(series, min_samples=self.min_samples, jump=self.jump):
                del series[:-3]                 # a new regime: forget the old speed
                self.trial.release()
            del series[:-self.window]
        if all(b > 0 for b in busy_s):
            self.trial.measure(busy_s)

    def estimates(self) -> list[float] | None:
        """Each stage's measured speed (relative to the profile's speed 1); None until enough data."""
        if any(len(s) < self.min_samples for s in self.speeds):
            return None
        return [statistics.median(s) for s in self.speeds]

    # -- the decision -----------------------------------------------------------------------------
    def propose(self, plan: Plan, *, step: int) -> Decision | None:
        """A new Plan with the blocks moved (the move is made, by every rank), or None."""
        speeds = self.estimates()
        if speeds is None or plan.replicas != 1 or len(plan.stage_blocks) != self.p:
            return None
        self._since_change += 1
        if self.trial.judging:
            return self._judge(plan, speeds, step)
        if self.trial.holding:
            return None
        current = self._evaluate(plan, self.sizes, speeds)
        best = self._best(plan, speeds, memory=True)
        refused = self._refused(plan, current, best, self._best(plan, speeds, memory=False), speeds)
        if best is None or best.sizes == self.sizes:
            self._streak, self._last = 0, None
            return None
        gain = current.step_seconds / best.step_seconds - 1
        if gain <= self.threshold:
            self._streak, self._last = 0, None
            return None
        self._streak = self._streak + 1 if self._last == best.sizes else 1
        self._last = best.sizes
        if self._streak < self._needed(gain) or self._since_change < self.cooldown:
            return None
        self.trial.start(list(self.sizes))
        return self._move(plan, best, current, speeds, step, f"measured speeds {self._speeds_text(speeds)}; "
                          f"predicted step {current.step_seconds * 1e3:.0f} -> {best.step_seconds * 1e3:.0f} ms "
                          f"(+{gain:.0%})" + (f"; {refused}" if refused else ""))

    def _needed(self, gain: float) -> int:
        return self.confirm if gain >= 3 * self.threshold else max(self.confirm, self.window)

    def _speeds_text(self, speeds: Sequence[float]) -> str:
        return ", ".join(f"{d.name} {v:.2f}" for d, v in zip(self.sizing.devices, speeds))

    def _refused(self, plan: Plan, current: PipelineSplit, best: PipelineSplit | None, free: PipelineSplit | None,
                 speeds: Sequence[float]) -> str:
        """A faster split the memory check refused: once it persisted as a move would have to, rank
        0's log names it (once), with every rank's numbers side by side. Returns a short note of it
        for a move's message ('' when none)."""
        if free is None or (best is not None and free.sizes == best.sizes):
            self._refused_streak, self._refused_last = 0, None
            return ""
        gain = current.step_seconds / free.step_seconds - 1
        if gain <= self.threshold:
            self._refused_streak, self._refused_last = 0, None
            return ""
        self._refused_streak = self._refused_streak + 1 if self._refused_last == free.sizes else 1
        self._refused_last = free.sizes
        short = f"{'/'.join(map(str, free.sizes))} (+{gain:.0%}) does not fit memory"
        if self._refused_streak < self._needed(gain) or self._logged == free.sizes:
            return short
        self._logged = free.sizes
        fits = self._evaluate(plan, free.sizes, speeds)         # the same split, its memory checked
        taken = (f"keeping {'/'.join(map(str, self.sizes))}" if best is None or best.sizes == self.sizes
                 else f"the best split that fits is {'/'.join(map(str, best.sizes))}")
        ranks = " | ".join(
            f"rank {s.index} {s.device}: speed {v:.2f}, blocks {s.start}-{s.stop - 1} need "
            f"{format_bytes(s.memory_bytes)} (now {format_bytes(now.memory_bytes)}) of "
            f"{format_bytes(s.memory_cap) if s.memory_cap is not None else 'unlimited'} usable"
            + ("" if s.fits else " (over)")
            for s, now, v in zip(fits.stages, current.stages, speeds))
        self.log.warn_job(
            f"pipeline re-split {'/'.join(map(str, self.sizes))} -> {'/'.join(map(str, free.sizes))} not made: "
            f"at the measured speeds it predicts a step of {current.step_seconds * 1e3:.0f} -> "
            f"{free.step_seconds * 1e3:.0f} ms (+{gain:.0%}), but it does not fit memory; {taken}: {ranks}")
        return short

    def _judge(self, plan: Plan, speeds: list[float], step: int) -> Decision | None:
        """The move under trial, once enough steps ran at its split: keep it if the measured
        imbalance fell by threshold / 2, else hold (and go back if it rose by as much)."""
        judged = self.trial.judge()
        if judged is None:
            return None
        verdict, sizes, now, before = judged
        if verdict != "back":
            return None           # 'keep': it paid, re-split on as before; 'hold': stay, and hold
        current = self._evaluate(plan, self.sizes, speeds)
        back = self._evaluate(plan, sizes, speeds)
        decision = self._move(plan, back, current, speeds, step,
                              f"back: the move did not pay (busiest stage ×{now:.2f} the mean at "
                              f"{'/'.join(map(str, self.sizes))}, ×{before:.2f} before it); held there "
                              "until a stage's speed changes")
        self.trial.holding = True
        return decision

    def _move(self, plan: Plan, new: PipelineSplit, current: PipelineSplit, speeds: Sequence[float], step: int,
              why: str) -> Decision | None:
        version = plan.version + 1
        failed = self.move(new, version)                   # a collective of the pipeline
        self._streak, self._last, self._since_change = 0, None, 0
        if failed is not None:                             # every rank saw the same refusal
            self.trial.pending, self.trial.holding = None, True
            self.log.warn_job(f"pipeline re-split {'/'.join(map(str, self.sizes))} -> "
                              f"{'/'.join(map(str, new.sizes))} not made: {failed}")
            return None
        self._fresh(new.sizes, judging=True)               # evidence at the new split only
        devices = tuple(replace(d, speed=v, predicted_memory_bytes=int(st.memory_bytes),
                                reasons=(f"stage {st.index} of replica 0: blocks {st.start}-{st.stop - 1} "
                                         f"(re-split at step {step})", *d.reasons[1:]))
                        for d, st, v in zip(plan.devices, new.stages, speeds))
        message = (f"pipeline re-split at step {step} (plan v{plan.version} -> v{version}): blocks per stage "
                   f"{'/'.join(map(str, current.sizes))} -> {'/'.join(map(str, new.sizes))}, moved with their "
                   f"parameters and optimizer state; {why}")
        # The prediction is the new split's at the measured speeds (the plan's sharing of a host's
        # cores, when it had one, is not re-costed: it was an estimate of the old split's).
        predicted = {"samples_per_s": plan.global_batch / new.step_seconds, "step_s": new.step_seconds}
        return Decision(plan=plan.evolve(note=message, devices=devices, stage_blocks=new.sizes, predicted=predicted),
                        message=message)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"kind": "resplit", "sizes": list(self.sizes), "speeds": self.speeds, "imbalance": self.trial.figures,
                "streak": self._streak, "last": list(self._last) if self._last else None,
                "since_change": self._since_change, "trial": self.trial.pending, "holding": self.trial.holding}

    def load_state_dict(self, state: dict) -> None:
        """Resume where it was when the resumed job runs the same split on as many stages (a
        resumed job that re-planned its split measures afresh: the evidence was of another split)."""
        if not isinstance(state, dict) or state.get("kind") != "resplit" or tuple(state["sizes"]) != self.sizes \
                or len(state["speeds"]) != self.p:
            return
        self.speeds = [list(v) for v in state["speeds"]]
        self.trial.figures = list(state["imbalance"])
        self._streak, self._since_change = state["streak"], state["since_change"]
        self._last = tuple(state["last"]) if state["last"] else None
        self.trial.pending, self.trial.holding = state["trial"], state["holding"]
