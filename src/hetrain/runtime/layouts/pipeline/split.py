"""Pipeline stages sized per device (pure; no torch). DP × PP, and the choice between DP, PP and
DP × PP for a model and cluster, are in planning/parallelism.py.

Model. A model is a stack of blocks (plus an optional `first` part, e.g. embeddings, pinned to
the first stage and a `last` part, e.g. final norm + head, pinned to the last). Each part has a
cost measured on one device and scaled to speed 1.0 (the cluster's fastest device):
  * `seconds`            forward + backward time per sample,
  * `activation_bytes`   bytes the forward keeps for the backward, per sample,
  * `param_bytes`        parameter bytes (the stage holds `state_factor` times that:
                         parameters, gradients and optimizer state, memory.state_factor;
                         4 for AdamW in fp32).

A pipeline of p stages runs m micro-batches of µ samples. Stage s (device speed v_s) holding
blocks [a, b) takes t_s = (f · µ · Σ_{i∈[a,b)} seconds_i + (b − a) · o) / v_s per micro-batch,
plus two sends over the link, when one is given (its output on, that output's gradient back:
collectives.send_seconds). f (`stage_factor`) and o (`block_s`) are how a stage runs a block
against the block's profiled time: o seconds a block per micro-batch whatever its size (the
pipeline machinery around every op) and f per row (measured where a pipeline is sized,
runtime/layouts/pipeline/probe.py; 1 and 0 when not measured).
With fixed per-stage times a fill-drain pipeline lasts Σ_s t_s + (m − 1)·max_s t_s, so the
slowest stage sets the pace: the split minimises max_s t_s (then Σ_s t_s). On a mixed machine a
uniform split leaves the fast devices waiting for the slow one; sizing stages by speed (a device
of speed 0.5 gets about half the blocks of one of speed 1) removes that wait.

Memory. Activations in flight depend on the schedule: GPipe runs every forward before any
backward, so each stage holds all m micro-batches; 1F1B starts backwards early, so stage s holds
at most min(m, p − s). Stage memory = state_factor · params + in_flight · µ · Σ activation_bytes
(+ the received inputs), which must fit the device's memory less a margin.

The bubble fraction (p − 1)/(m + p − 1) is the idle share of a pipeline with equal stages; more
micro-batches shrink it, at the cost of smaller (less efficient) micro-batches.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ....errors import UsageError
from ....vocabulary import SCHEDULES
from ....hardware.units import format_bytes as _gib
from ....planning.collectives import FREE_LINK, Link, send_seconds
from ....planning.memory import ADAMW_STATE_FACTOR
from ....planning.plan import split_evenly
from .profile import BlockCost, PipelineProfile
from .stage_plan import PipelineSplit, StagePlan, bubble_fraction

__all__ = ["RESPLIT_NOTE", "BlockCost", "PipelineProfile", "StageDevice", "StagePlan", "PipelineSplit", "StageCosts",
           "bubble_fraction", "in_flight", "stage_devices", "split_pipeline", "evaluate_split"]

_EPS = 1e-12
# What a plain pipeline's plan and ranking say of the runtime's online re-split
# (runtime/layouts/pipeline/resplit.py): the split above is where it starts, not where it must stay.
RESPLIT_NOTE = ("re-split online: when a stage's measured speed changes, blocks move between stages "
                "with their optimizer state at a step boundary (when the faster split fits memory)")


# -- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StageDevice:
    """A device that can hold a stage: `speed` relative to the fastest (1.0), memory in bytes."""

    name: str
    speed: float
    memory_bytes: float | None = None   # None: memory not limited (not checked)

    def __post_init__(self) -> None:
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise UsageError(f"device {self.name}: speed {self.speed!r} must be a positive number",
                             "check the cluster spec (NAME:SPEED) or the measured speeds")


def stage_devices(cluster) -> tuple[StageDevice, ...]:
    """StageDevices from a parsed cluster spec (`hardware.cluster.parse_cluster`), in rank order."""
    return tuple(StageDevice(name=d.label, speed=d.speed, memory_bytes=d.memory_bytes) for d in cluster)


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under `schedule`."""
    _check_schedule(schedule)
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def micro_batch_cut(share: int, micro_batches: int, *, stages: int, schedule: str) -> tuple[int, int]:
    """(µ, n): how a pipeline replica cuts its `share` of the step asked to run `micro_batches`,
    as the runtime runs it (planning/plan.DevicePlan: micro_batch µ, n_micro n). Every micro-batch
    is padded to µ rows (the pipelining schedule's buffers have one shape), so µ = ⌈share/m⌉ and
    only n = ⌈share/µ⌉ of them are needed: 19 samples asked in 8 run as 7 of 3, not 8 of 3 (24
    padded rows, one more micro-batch's fixed cost). 1F1B needs at least one micro-batch per stage:
    when that cut leaves fewer (9 in 8 gives 5 of 2; 8 stages), µ = ⌊share/p⌋ instead, so n ≥ p."""
    share, m = max(1, int(share)), max(1, int(micro_batches))
    mu = -(-share // m)
    n = -(-share // mu)
    if schedule == "1f1b" and n < stages <= share:
        mu = share // stages
        n = -(-share // mu)
    return mu, n


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")


# -- one pipeline -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StageCosts:
    """Everything a stage's cost depends on, precomputed as prefix sums. `stage` builds a
    StagePlan for devices[s] at micro_batch_size; the DP×PP search (planning/hybrid_search.py)
    calls the same `totals` / `seconds_per_micro` / `memory` for other devices and micro-batch
    sizes, so its numbers are these, bit for bit."""

    profile: PipelineProfile
    devices: tuple[StageDevice, ...]
    schedule: str
    micro_batches: int
    micro_batch_size: int
    state_factor: float
    memory_margin: float
    link: Link
    sec: tuple[float, ...] = field(default=())
    act: tuple[float, ...] = field(default=())
    par: tuple[float, ...] = field(default=())

    @classmethod
    def make(cls, profile, devices, *, schedule, micro_batches, micro_batch_size, state_factor,
             memory_margin, link: Link | None) -> StageCosts:
        _check_schedule(schedule)
        p, n = len(devices), profile.n_blocks
        if p < 1:
            raise UsageError("no devices to hold pipeline stages", "give at least one device")
        if p > n:
            raise UsageError(
                f"cannot cut {n} blocks into {p} pipeline stages (every stage needs at least one block)",
                f"use at most {n} stages: pipeline over fewer devices, or combine data and pipeline "
                "parallelism (DP×PP) so each pipeline has fewer stages")
        if micro_batches < 1 or micro_batch_size < 1:
            raise UsageError(f"{micro_batches} micro-batches of {micro_batch_size} samples",
                             "use at least one micro-batch of at least one sample")
        if schedule == "1f1b" and micro_batches < p:
            raise UsageError(f"1F1B over {p} stages needs at least {p} micro-batches, got {micro_batches}",
                             f"use micro_batches >= {p}, or schedule='gpipe'")
        if not 0 <= memory_margin < 1:
            raise UsageError(f"memory_margin={memory_margin}", "use a fraction in [0, 1)")
        sec, act, par = ((0.0, *itertools.accumulate(getattr(b, what) for b in profile.blocks))
                         for what in ("seconds", "activation_bytes", "param_bytes"))
        return cls(profile, tuple(devices), schedule, micro_batches, micro_batch_size, state_factor,
                   memory_margin, FREE_LINK if link is None else link, sec, act, par)

    @property
    def p(self) -> int:
        return len(self.devices)

    def totals(self, s: int, a: int, b: int) -> tuple[float, float, float]:
        """Per sample at speed 1.0: seconds, activation bytes and parameter bytes of stage s
        holding blocks [a, b), with the first/last parts on the first/last stage."""
        prof, p = self.profile, self.p
        seconds, acts, params = self.sec[b] - self.sec[a], self.act[b] - self.act[a], self.par[b] - self.par[a]
        for part, here in ((prof.first, s == 0), (prof.last, s == p - 1)):
            if part is not None and here:
                seconds += part.seconds
                acts += part.activation_bytes
                params += part.param_bytes
        if p == 1 and prof.first is not None and prof.last is not None:
            params -= prof.tied_param_bytes      # one stage holds the tied weight once
        return seconds, acts, params

    def seconds_per_micro(self, s: int, seconds: float, speed: float, mu: int, *, blocks: int) -> float:
        """Compute (µ samples of the stage's `blocks` blocks, as a stage runs them: stage_factor
        a row, block_s a block), plus sending the activation on and receiving its gradient back
        (not the last stage)."""
        prof = self.profile
        fixed = blocks * prof.block_s + (prof.first_s if s == 0 else 0.0) + (prof.last_s if s == self.p - 1 else 0.0)
        t = (mu * seconds * prof.stage_factor + fixed) / speed
        if s < self.p - 1:
            t += 2 * send_seconds(mu * self.profile.boundary_bytes, self.link)
        return t

    def memory(self, s: int, acts: float, params: float, mu: int,
               micro_batches: int | None = None) -> tuple[int, float, float]:
        """(micro-batches in flight, state bytes, activation bytes incl. the received inputs), with
        `micro_batches` a step (default this setup's)."""
        flight = in_flight(self.schedule, s, self.p, micro_batches or self.micro_batches)
        received = self.profile.boundary_bytes if s > 0 else 0.0
        return flight, self.state_factor * params, flight * mu * (acts + received)

    def cap(self, memory_bytes: float | None) -> float | None:
        return None if memory_bytes is None else memory_bytes * (1 - self.memory_margin)

    def stage(self, s: int, a: int, b: int) -> StagePlan:
        dev, mu = self.devices[s], self.micro_batch_size
        seconds, acts, params = self.totals(s, a, b)
        flight, state, activations = self.memory(s, acts, params, mu)
        return StagePlan(index=s, device=dev.name, speed=dev.speed, start=a, stop=b,
                         seconds_per_micro=self.seconds_per_micro(s, seconds, dev.speed, mu, blocks=b - a),
                         in_flight=flight,
                         param_bytes=params, state_bytes=state, activation_bytes=activations,
                         memory_cap=self.cap(dev.memory_bytes))

    def split(self, sizes: Sequence[int], reasons: tuple[str, ...] = ()) -> PipelineSplit:
        edges = (0, *itertools.accumulate(sizes))
        return PipelineSplit(stages=tuple(self.stage(s, edges[s], edges[s + 1]) for s in range(len(sizes))),
                             schedule=self.schedule, micro_batches=self.micro_batches,
                             micro_batch_size=self.micro_batch_size, reasons=reasons)


def _min_max_dp(setup: StageCosts, key) -> tuple[tuple[int, ...], tuple] | None:
    """Contiguous split minimising (max_s key, Σ_s key) over stages that fit (key → None: skip).

    best[s][j]: the best value with stages 0..s−1 covering blocks [0, j). O(p·n²)."""
    p, n = setup.p, setup.profile.n_blocks
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    back = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(p):
        for j in range(s + 1, n - (p - 1 - s) + 1):          # leave one block per later stage
            for i in range(s, j):
                if best[s][i] == inf:
                    continue
                v = key(setup.stage(s, i, j))
                if v is None:
                    continue
                cand = (max(best[s][i][0], v), best[s][i][1] + v)
                if cand < best[s + 1][j]:
                    best[s + 1][j], back[s + 1][j] = cand, i
    if best[p][n] == inf:
        return None
    edges, j = [n], n
    for s in range(p, 0, -1):
        j = back[s][j]
        edges.append(j)
    edges.reverse()              # 0, the first block of stage 1, …, n
    return tuple(b - a for a, b in zip(edges, edges[1:])), best[p][n]


def split_pipeline(profile: PipelineProfile, devices: Sequence[StageDevice], *, micro_batches: int,
                   micro_batch_size: int, schedule: str = "1f1b", state_factor: float = ADAMW_STATE_FACTOR,
                   memory_margin: float = 0.10, link: Link | None = None) -> PipelineSplit:
    """The contiguous split of the blocks over `devices` (stage i on devices[i]) that minimises the
    slowest stage's time per micro-batch, every stage fitting its device's memory.

    Raises UsageError when no split exists (more stages than blocks) or none fits memory, naming
    the stage that overflows in the least-memory split and what to try.

    Complexity: O(n) prefix sums, then the min-max DP over (stage, last block) pairs, O(p·n²)
    stage costs for p stages and n blocks (once more to explain a split that does not fit)."""
    setup = StageCosts.make(profile, devices, schedule=schedule, micro_batches=micro_batches, link=link,
                        micro_batch_size=micro_batch_size, state_factor=state_factor, memory_margin=memory_margin)
    found = _min_max_dp(setup, lambda st: st.seconds_per_micro if st.fits else None)
    if found is None:
        raise _no_fit(setup)
    sizes, _ = found
    uniform = setup.split(split_evenly(profile.n_blocks, setup.p))
    chosen = setup.split(sizes)
    reasons = [f"blocks per stage {'/'.join(map(str, sizes))}: the slowest stage takes "
               f"{chosen.bottleneck.seconds_per_micro * 1e3:.3g} ms per micro-batch of {micro_batch_size} "
               f"(stage {chosen.bottleneck.index}, {chosen.bottleneck.device})"]
    if sizes != uniform.sizes:
        fit = "" if uniform.fits else ", and does not fit memory"
        reasons.append(f"a uniform split {'/'.join(map(str, uniform.sizes))} would take "
                       f"{uniform.bottleneck.seconds_per_micro * 1e3:.3g} ms (predicted "
                       f"{chosen.samples_per_s / max(uniform.samples_per_s, _EPS):.2f}x slower{fit})")
    reasons.append(f"{schedule}: {micro_batches} micro-batches, bubble fraction "
                   f"{chosen.bubble_fraction:.0%} = (p−1)/(m+p−1)")
    reasons.append(f"block costs {profile.source}")
    return setup.split(sizes, tuple(reasons))


def evaluate_split(profile: PipelineProfile, devices: Sequence[StageDevice], sizes: Sequence[int], *,
                   micro_batches: int, micro_batch_size: int, schedule: str = "1f1b",
                   state_factor: float = ADAMW_STATE_FACTOR, memory_margin: float = 0.10,
                   link: Link | None = None) -> PipelineSplit:
    """What a given split (blocks per stage) predicts; `fits` says whether it fits memory."""
    setup = StageCosts.make(profile, devices, schedule=schedule, micro_batches=micro_batches, link=link,
                        micro_batch_size=micro_batch_size, state_factor=state_factor, memory_margin=memory_margin)
    sizes = tuple(int(k) for k in sizes)
    if len(sizes) != setup.p or any(k < 1 for k in sizes) or sum(sizes) != profile.n_blocks:
        raise UsageError(f"split {list(sizes)} does not cut {profile.n_blocks} blocks into {setup.p} stages",
                         f"give {setup.p} positive block counts that sum to {profile.n_blocks}, "
                         f"e.g. {list(split_evenly(profile.n_blocks, setup.p))}")
    return setup.split(sizes, (f"split {'/'.join(map(str, sizes))} given",))


def _no_fit(setup: StageCosts) -> UsageError:
    """Explain why no split fits: the split needing the least memory, and its worst stage."""
    least = _min_max_dp(setup, lambda st: st.memory_bytes / st.memory_cap if st.memory_cap else 0.0)
    worst = max(setup.split(least[0]).stages, key=lambda st: st.memory_bytes / (st.memory_cap or math.inf))
    what = (f"no split of {setup.profile.n_blocks} blocks over {setup.p} stages fits memory: even the "
            f"least-memory split {'/'.join(map(str, least[0]))} needs {_gib(worst.memory_bytes)} on stage "
            f"{worst.index} ({worst.device}: {_gib(worst.state_bytes)} parameters+gradients+optimizer, "
            f"{_gib(worst.activation_bytes)} activations for {worst.in_flight} micro-batches in flight), "
            f"{_gib(worst.memory_cap)} usable")
    tries = []
    if setup.schedule == "gpipe" and setup.micro_batches > 1:
        tries.append("schedule='1f1b' (a stage holds at most p−stage micro-batches, not all of them)")
    if setup.micro_batch_size > 1:
        tries.append("smaller micro-batches (more of them)")
    tries += ["activation checkpointing", "sharding parameters and optimizer state (FSDP)",
              "more stages on more devices, or devices with more memory"]
    return UsageError(what, "try " + "; ".join(tries))
