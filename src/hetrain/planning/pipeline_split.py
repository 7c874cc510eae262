"""Pipeline stages sized per device, and the choice between DP, PP and DP×PP (pure; no torch).

Model. A model is a stack of blocks (plus an optional `first` part, e.g. embeddings, pinned to
the first stage and a `last` part, e.g. final norm + head, pinned to the last). Each part has a
cost measured on one device and scaled to speed 1.0 (the cluster's fastest device):
  * `seconds`            forward + backward time per sample,
  * `activation_bytes`   bytes the forward keeps for the backward, per sample,
  * `param_bytes`        parameter bytes (the stage holds `state_factor` times that:
                         parameters, gradients and optimizer state; 4 for Adam in fp32).

A pipeline of p stages runs m micro-batches of µ samples. Stage s (device speed v_s) holding
blocks [a, b) takes t_s = µ · Σ_{i∈[a,b)} seconds_i / v_s per micro-batch, plus the time to send
its output on. With fixed per-stage times a fill-drain pipeline lasts Σ_s t_s + (m − 1)·max_s t_s,
so the slowest stage sets the pace: the split minimises max_s t_s (then Σ_s t_s). On a mixed
machine a uniform split leaves the fast devices waiting for the slow one; sizing stages by speed
(a device of speed 0.5 gets about half the blocks of one of speed 1) removes that wait.

Memory. Activations in flight depend on the schedule: GPipe runs every forward before any
backward, so each stage holds all m micro-batches; 1F1B starts backwards early, so stage s holds
at most min(m, p − s). Stage memory = state_factor · params + in_flight · µ · Σ activation_bytes
(+ the received inputs), which must fit the device's memory less a margin.

The bubble fraction (p − 1)/(m + p − 1) is the idle share of a pipeline with equal stages; more
micro-batches shrink it, at the cost of smaller (less efficient) micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import UsageError
from ..hardware.units import format_bytes
from .plan import split_evenly
from .shares import proportional_shares

SCHEDULES = ("gpipe", "1f1b")
_EPS = 1e-12


def _gib(n: float) -> str:
    return format_bytes(n)


# -- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """One part of the model, per sample, at speed 1.0."""

    seconds: float                 # forward + backward, per sample
    activation_bytes: float = 0.0  # kept from forward to backward, per sample
    param_bytes: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        for what in ("seconds", "activation_bytes", "param_bytes"):
            value = getattr(self, what)
            if not (value >= 0 and math.isfinite(value)):
                raise UsageError(f"block {self.name or '?'}: {what}={value!r} must be a finite number >= 0",
                                 "profile the model again, or give non-negative costs")


@dataclass(frozen=True, kw_only=True)
class PipelineProfile:
    """Costs of a model's blocks (and its first/last parts), e.g. from `parallel.pipeline.profile_blocks`."""

    blocks: tuple[BlockCost, ...]
    first: BlockCost | None = None     # runs before the blocks, on the first stage
    last: BlockCost | None = None      # runs after the blocks, on the last stage
    boundary_bytes: float = 0.0        # activation bytes per sample sent from one stage to the next
    tied_param_bytes: float = 0.0      # parameters the first and last parts share (held twice)
    source: str = "given"              # e.g. 'measured on rank 0 (speed 1.0), 4 samples'

    def __post_init__(self) -> None:
        if not self.blocks:
            raise UsageError("the model has no blocks to split into stages",
                             "give a model with a list of blocks (nn.Sequential, ModuleList, or PipelineParts)")

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def parts(self) -> tuple[BlockCost, ...]:
        return tuple(p for p in (self.first, *self.blocks, self.last) if p is not None)

    @property
    def seconds_per_sample(self) -> float:
        return sum(p.seconds for p in self.parts())

    @property
    def param_bytes(self) -> float:
        """Parameter bytes of the whole model (the tied weight counted once)."""
        return sum(p.param_bytes for p in self.parts()) - self.tied_param_bytes

    @property
    def activation_bytes_per_sample(self) -> float:
        return sum(p.activation_bytes for p in self.parts())


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


# -- results ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    device: str
    speed: float
    start: int                         # first block (inclusive)
    stop: int                          # last block (exclusive)
    seconds_per_micro: float           # compute + send of one micro-batch, forward + backward
    in_flight: int                     # micro-batches whose activations this stage holds at once
    state_bytes: float                 # parameters + gradients + optimizer state
    activation_bytes: float            # in_flight micro-batches of activations (+ received inputs)
    memory_cap: float | None           # usable bytes (device memory less the margin); None: unlimited

    @property
    def n_blocks(self) -> int:
        return self.stop - self.start

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.memory_cap is None or self.memory_bytes <= self.memory_cap


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """A partition of the blocks into stages, with what it predicts."""

    stages: tuple[StagePlan, ...]
    schedule: str
    micro_batches: int
    micro_batch_size: int
    reasons: tuple[str, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        """Blocks per stage, e.g. (8, 4)."""
        return tuple(s.n_blocks for s in self.stages)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.start, s.stop) for s in self.stages)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.n_stages, self.micro_batches)

    @property
    def bottleneck(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.seconds_per_micro)

    @property
    def step_seconds(self) -> float:
        """Fill-drain estimate: Σ_s t_s + (m − 1)·max_s t_s."""
        t = [s.seconds_per_micro for s in self.stages]
        return sum(t) + (self.micro_batches - 1) * max(t)

    @property
    def samples_per_s(self) -> float:
        return self.micro_batches * self.micro_batch_size / max(self.step_seconds, _EPS)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def describe(self) -> list[str]:
        """One line per stage, for people."""
        lines = []
        for s in self.stages:
            cap = f" of {_gib(s.memory_cap)}" if s.memory_cap is not None else ""
            lines.append(f"stage {s.index} on {s.device} (speed {s.speed:.3g}): blocks {s.start}-{s.stop - 1} "
                         f"({s.n_blocks}), {s.seconds_per_micro * 1e3:.3g} ms/micro-batch, "
                         f"{s.in_flight} in flight, {_gib(s.memory_bytes)}{cap}")
        return lines


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """(p − 1)/(m + p − 1): the idle share of a pipeline of p equal stages over m micro-batches."""
    if stages < 1 or micro_batches < 1:
        raise UsageError(f"{stages} stages and {micro_batches} micro-batches", "use at least one of each")
    return (stages - 1) / (micro_batches + stages - 1)


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under `schedule`."""
    _check_schedule(schedule)
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, stages - stage)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}", f"use one of {', '.join(SCHEDULES)}")


# -- one pipeline -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Setup:
    """Everything a stage's cost depends on, precomputed as prefix sums."""

    profile: PipelineProfile
    devices: tuple[StageDevice, ...]
    schedule: str
    micro_batches: int
    micro_batch_size: int
    state_factor: float
    memory_margin: float
    link_bytes_per_s: float | None
    sec: tuple[float, ...] = field(default=())
    act: tuple[float, ...] = field(default=())
    par: tuple[float, ...] = field(default=())

    @classmethod
    def make(cls, profile, devices, *, schedule, micro_batches, micro_batch_size, state_factor,
             memory_margin, link_bytes_per_s) -> _Setup:
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
        if link_bytes_per_s is not None and not link_bytes_per_s > 0:
            raise UsageError(f"link bandwidth {link_bytes_per_s!r}", "give a positive bytes/s, or None")
        sec, act, par = [0.0], [0.0], [0.0]
        for b in profile.blocks:
            sec.append(sec[-1] + b.seconds)
            act.append(act[-1] + b.activation_bytes)
            par.append(par[-1] + b.param_bytes)
        return cls(profile, tuple(devices), schedule, micro_batches, micro_batch_size, state_factor,
                   memory_margin, link_bytes_per_s, tuple(sec), tuple(act), tuple(par))

    @property
    def p(self) -> int:
        return len(self.devices)

    def stage(self, s: int, a: int, b: int) -> StagePlan:
        prof, dev, mu, p = self.profile, self.devices[s], self.micro_batch_size, self.p
        seconds, acts, params = self.sec[b] - self.sec[a], self.act[b] - self.act[a], self.par[b] - self.par[a]
        for part, here in ((prof.first, s == 0), (prof.last, s == p - 1)):
            if part is not None and here:
                seconds += part.seconds
                acts += part.activation_bytes
                params += part.param_bytes
        if p == 1 and prof.first is not None and prof.last is not None:
            params -= prof.tied_param_bytes      # one stage holds the tied weight once
        t = mu * seconds / dev.speed
        if self.link_bytes_per_s and s < p - 1:   # send the activation on, receive its gradient back
            t += 2 * mu * prof.boundary_bytes / self.link_bytes_per_s
        flight = in_flight(self.schedule, s, p, self.micro_batches)
        received = prof.boundary_bytes if s > 0 else 0.0
        cap = None if dev.memory_bytes is None else dev.memory_bytes * (1 - self.memory_margin)
        return StagePlan(index=s, device=dev.name, speed=dev.speed, start=a, stop=b, seconds_per_micro=t,
                         in_flight=flight, state_bytes=self.state_factor * params,
                         activation_bytes=flight * mu * (acts + received), memory_cap=cap)

    def split(self, sizes: Sequence[int], reasons: tuple[str, ...] = ()) -> PipelineSplit:
        bounds, a = [], 0
        for k in sizes:
            bounds.append((a, a + k))
            a += k
        return PipelineSplit(stages=tuple(self.stage(s, x, y) for s, (x, y) in enumerate(bounds)),
                             schedule=self.schedule, micro_batches=self.micro_batches,
                             micro_batch_size=self.micro_batch_size, reasons=reasons)


def _sizes_from(cuts: list[int], n: int) -> tuple[int, ...]:
    edges = [*cuts, n]
    return tuple(edges[i + 1] - edges[i] for i in range(len(cuts)))


def _min_max_dp(setup: _Setup, key) -> tuple[tuple[int, ...], tuple] | None:
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
    cuts, j = [], n
    for s in range(p, 0, -1):
        j = back[s][j]
        cuts.append(j)
    return _sizes_from(cuts[::-1], n), best[p][n]


def split_pipeline(profile: PipelineProfile, devices: Sequence[StageDevice], *, micro_batches: int,
                   micro_batch_size: int, schedule: str = "1f1b", state_factor: float = 4.0,
                   memory_margin: float = 0.10, link_bytes_per_s: float | None = None) -> PipelineSplit:
    """The contiguous split of the blocks over `devices` (stage i on devices[i]) that minimises the
    slowest stage's time per micro-batch, every stage fitting its device's memory.

    Raises UsageError when no split exists (more stages than blocks) or none fits memory, naming
    the stage that overflows in the least-memory split and what to try."""
    setup = _Setup.make(profile, devices, schedule=schedule, micro_batches=micro_batches,
                        micro_batch_size=micro_batch_size, state_factor=state_factor,
                        memory_margin=memory_margin, link_bytes_per_s=link_bytes_per_s)
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
                   state_factor: float = 4.0, memory_margin: float = 0.10,
                   link_bytes_per_s: float | None = None) -> PipelineSplit:
    """What a given split (blocks per stage) predicts; `fits` says whether it fits memory."""
    setup = _Setup.make(profile, devices, schedule=schedule, micro_batches=micro_batches,
                        micro_batch_size=micro_batch_size, state_factor=state_factor,
                        memory_margin=memory_margin, link_bytes_per_s=link_bytes_per_s)
    sizes = tuple(int(k) for k in sizes)
    if len(sizes) != setup.p or any(k < 1 for k in sizes) or sum(sizes) != profile.n_blocks:
        raise UsageError(f"split {list(sizes)} does not cut {profile.n_blocks} blocks into {setup.p} stages",
                         f"give {setup.p} positive block counts that sum to {profile.n_blocks}, "
                         f"e.g. {list(split_evenly(profile.n_blocks, setup.p))}")
    return setup.split(sizes, (f"split {'/'.join(map(str, sizes))} given",))


def _no_fit(setup: _Setup) -> UsageError:
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


# -- several pipelines: DP × PP ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HybridSplit:
    """D pipeline replicas of p stages with one common split; replica r computes `shares[r]`
    samples of each global batch, in proportion to its pipeline's throughput."""

    sizes: tuple[int, ...]
    replicas: tuple[PipelineSplit, ...]    # each at its own micro-batch size
    shares: tuple[int, ...]
    global_batch: int
    reasons: tuple[str, ...] = ()

    @property
    def step_seconds(self) -> float:
        return max(r.step_seconds for r in self.replicas)

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / max(self.step_seconds, _EPS)


def _replica_groups(devices: Sequence[StageDevice], stages: int) -> list[tuple[StageDevice, ...]]:
    w = len(devices)
    if stages < 1 or w % stages:
        raise UsageError(f"{w} devices do not form pipelines of {stages} stages",
                         f"use a stage count that divides {w}")
    return [tuple(devices[r * stages:(r + 1) * stages]) for r in range(w // stages)]


def evaluate_hybrid(profile: PipelineProfile, devices: Sequence[StageDevice], sizes: Sequence[int], *,
                    stages: int, global_batch: int, micro_batches: int, shares: Sequence[int] | None = None,
                    schedule: str = "1f1b", state_factor: float = 4.0, memory_margin: float = 0.10,
                    link_bytes_per_s: float | None = None) -> HybridSplit:
    """DP×PP with a given split: replica r holds devices [r·p, (r+1)·p) (the rank layout of a
    (dp, pp) mesh) and computes `shares[r]` samples per step — by default in proportion to its
    pipeline's throughput (1 / its slowest stage), the hetero shares of data parallelism applied
    to whole pipelines. Each replica runs `micro_batches` micro-batches of ceil(share / m)."""
    groups = _replica_groups(devices, stages)
    d = len(groups)
    common = dict(schedule=schedule, micro_batches=micro_batches, state_factor=state_factor,
                  memory_margin=memory_margin, link_bytes_per_s=link_bytes_per_s)
    if shares is None:
        if global_batch < d * micro_batches:
            raise UsageError(f"global batch {global_batch} cannot give {d} replicas {micro_batches} "
                             "micro-batches each", f"use a global batch of at least {d * micro_batches}, "
                             "or fewer micro-batches")
        per_sample = [evaluate_split(profile, g, sizes, micro_batch_size=1, **common) for g in groups]
        speeds = [1.0 / max(s.bottleneck.seconds_per_micro, _EPS) for s in per_sample]
        shares = proportional_shares(global_batch, speeds)
        how = "in proportion to each pipeline's throughput (its slowest stage)"
    else:
        shares = tuple(int(b) for b in shares)
        how = "given"
    if len(shares) != d or sum(shares) != global_batch or min(shares) < micro_batches:
        raise UsageError(f"replica shares {list(shares)} for {d} replicas, global batch {global_batch}, "
                         f"{micro_batches} micro-batches",
                         f"give {d} shares of at least {micro_batches} that sum to {global_batch}")
    reps = tuple(evaluate_split(profile, g, sizes, micro_batch_size=math.ceil(b / micro_batches), **common)
                 for g, b in zip(groups, shares))
    reasons = (f"{d} replicas × {stages} stages, blocks per stage {'/'.join(map(str, reps[0].sizes))} "
               "in every replica (data parallelism averages the same blocks stage by stage)",
               f"replica shares {'/'.join(map(str, shares))} of {global_batch}: {how}")
    return HybridSplit(sizes=reps[0].sizes, replicas=reps, shares=tuple(shares), global_batch=global_batch,
                       reasons=reasons)


def split_hybrid(profile: PipelineProfile, devices: Sequence[StageDevice], *, stages: int, global_batch: int,
                 micro_batches: int, schedule: str = "1f1b", state_factor: float = 4.0,
                 memory_margin: float = 0.10, link_bytes_per_s: float | None = None,
                 max_candidates: int = 20_000) -> HybridSplit:
    """The common split for DP×PP (see `evaluate_hybrid`) that maximises the replicas' total
    throughput, every stage fitting its device at its replica's micro-batch size. All replicas
    use one split because data parallelism averages the gradients of the same blocks stage by
    stage."""
    groups = _replica_groups(devices, stages)
    d, n = len(groups), profile.n_blocks
    common = dict(stages=stages, global_batch=global_batch, micro_batches=micro_batches, schedule=schedule,
                  state_factor=state_factor, memory_margin=memory_margin, link_bytes_per_s=link_bytes_per_s)
    if stages > n:
        _Setup.make(profile, groups[0], micro_batches=micro_batches, micro_batch_size=1, schedule=schedule,
                    state_factor=state_factor, memory_margin=memory_margin, link_bytes_per_s=link_bytes_per_s)
    if math.comb(n - 1, stages - 1) <= max_candidates:
        candidates = _compositions(n, stages)
    else:   # too many to try: split for the slowest device at each stage position, then evaluate
        weakest = [StageDevice(name=f"stage {s}", speed=min(g[s].speed for g in groups),
                               memory_bytes=min((g[s].memory_bytes for g in groups if g[s].memory_bytes),
                                                default=None)) for s in range(stages)]
        candidates = [split_pipeline(profile, weakest, micro_batches=micro_batches,
                                     micro_batch_size=math.ceil(global_batch / d / micro_batches),
                                     schedule=schedule, state_factor=state_factor, memory_margin=memory_margin,
                                     link_bytes_per_s=link_bytes_per_s).sizes]
    best = None
    for sizes in candidates:
        h = evaluate_hybrid(profile, devices, sizes, **common)
        if all(r.fits for r in h.replicas) and (best is None or h.samples_per_s > best.samples_per_s * (1 + 1e-9)):
            best = h
    if best is None:
        micro = math.ceil(global_batch / d / micro_batches)
        for g in groups:     # a replica that cannot fit on its own explains best
            try:
                split_pipeline(profile, g, micro_batches=micro_batches, micro_batch_size=micro, schedule=schedule,
                               state_factor=state_factor, memory_margin=memory_margin,
                               link_bytes_per_s=link_bytes_per_s)
            except UsageError as e:
                raise UsageError(f"DP×PP {d}×{stages}: {e.what}", e.fix) from None
        raise UsageError(f"DP×PP {d}×{stages}: no common split fits every replica's memory",
                         "try more micro-batches, activation checkpointing, or sharding (FSDP)")
    details = tuple(f"replica {r}: " + line for r, rep in enumerate(best.replicas) for line in rep.describe())
    return HybridSplit(sizes=best.sizes, replicas=best.replicas, shares=best.shares, global_batch=global_batch,
                       reasons=best.reasons + details + (f"block costs {profile.source}",))


def _compositions(n: int, k: int):
    """Every way to write n as k positive parts, in order."""
    if k == 1:
        yield (n,)
        return
    for first in range(1, n - k + 2):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


# -- DP vs PP vs DP×PP ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Candidate:
    name: str                          # 'DP', 'PP 4 stages', 'DP×PP 2×2'
    kind: str                          # 'dp' | 'pp' | 'dp×pp'
    fits: bool
    samples_per_s: float               # predicted; 0 when it does not fit
    detail: str                        # how it would run, or why it does not fit
    replicas: int = 1
    stages: int = 1
    sizes: tuple[int, ...] = ()        # blocks per stage (PP, DP×PP)
    shares: tuple[int, ...] = ()       # samples per replica (DP: per device)


@dataclass(frozen=True, kw_only=True)
class ParallelismChoice:
    """What `compare_parallelism` picked, the reason, and every candidate it weighed."""

    choice: Candidate
    reason: str
    candidates: tuple[Candidate, ...]

    def describe(self) -> list[str]:
        lines = [f"parallelism: {self.choice.name} — {self.reason}"]
        for c in self.candidates:
            speed = f"{c.samples_per_s:.1f} samples/s predicted" if c.fits else "does not fit"
            lines.append(f"  {c.name}: {speed}; {c.detail}")
        return lines


def _allreduce_seconds(nbytes: float, world: int, link_bytes_per_s: float | None) -> float:
    """Ring all-reduce: 2(n−1)/n · S / B."""
    if world < 2 or not link_bytes_per_s:
        return 0.0
    return 2 * (world - 1) / world * nbytes / link_bytes_per_s


def _dp_candidate(profile, devices, *, global_batch, state_factor, memory_margin, link_bytes_per_s) -> Candidate:
    state = state_factor * profile.param_bytes
    act = profile.activation_bytes_per_sample
    short: dict[str, list[str]] = {}     # usable memory -> devices that lack it
    for dv in devices:
        if dv.memory_bytes is not None and state + act > dv.memory_bytes * (1 - memory_margin):
            short.setdefault(_gib(dv.memory_bytes * (1 - memory_margin)), []).append(dv.name)
    if short:
        return Candidate(name="DP", kind="dp", fits=False, samples_per_s=0.0, replicas=len(devices),
                         detail=f"the whole model and one sample need {_gib(state + act)}; "
                         + "; ".join(f"{', '.join(names)}: {usable} usable" for usable, names in short.items()))
    if global_batch < len(devices):
        return Candidate(name="DP", kind="dp", fits=False, samples_per_s=0.0, replicas=len(devices),
                         detail=f"global batch {global_batch} < {len(devices)} devices")
    shares = proportional_shares(global_batch, [dv.speed for dv in devices])
    compute = max(b * profile.seconds_per_sample / dv.speed for b, dv in zip(shares, devices))
    sync = _allreduce_seconds(profile.param_bytes, len(devices), link_bytes_per_s)
    return Candidate(name="DP" if len(devices) > 1 else "one device", kind="dp", fits=True,
                     samples_per_s=global_batch / max(compute + sync, _EPS), replicas=len(devices),
                     shares=shares,
                     detail=f"every device holds the whole model ({_gib(state)} with gradients and optimizer); "
                            f"shares {'/'.join(map(str, shares))} by speed"
                            + (f"; gradient all-reduce {sync * 1e3:.3g} ms" if sync else ""))


def compare_parallelism(profile: PipelineProfile, devices: Sequence[StageDevice], *, global_batch: int,
                        micro_batches: int = 8, schedule: str = "1f1b", state_factor: float = 4.0,
                        memory_margin: float = 0.10, link_bytes_per_s: float | None = None,
                        prefer_simpler_within: float = 0.05) -> ParallelismChoice:
    """Predict data parallelism (every device holds the model, hetero shares), one pipeline over all
    devices, and every DP×PP layout (replicas of p consecutive devices, p dividing the device
    count), then pick the fastest that fits memory. A simpler layout (DP, then PP, then DP×PP) wins
    when it is within `prefer_simpler_within` of the fastest: fewer moving parts for the same speed.

    Raises UsageError when nothing fits, with each candidate's reason and what to try."""
    w = len(devices)
    if w < 1:
        raise UsageError("no devices to compare layouts on", "give at least one device")
    if global_batch < 1:
        raise UsageError(f"global batch {global_batch}", "use a positive global batch")
    common = dict(schedule=schedule, state_factor=state_factor, memory_margin=memory_margin,
                  link_bytes_per_s=link_bytes_per_s)
    cands = [_dp_candidate(profile, devices, global_batch=global_batch, state_factor=state_factor,
                           memory_margin=memory_margin, link_bytes_per_s=link_bytes_per_s)]
    for stages in range(2, w + 1):
        if w % stages:
            continue
        d = w // stages
        name = f"PP {stages} stages" if d == 1 else f"DP×PP {d}×{stages}"
        kind = "pp" if d == 1 else "dp×pp"
        m = micro_batches if schedule == "gpipe" else max(micro_batches, stages)
        try:
            if d == 1:   # one pipeline: the min-max split the runtime uses
                one = split_pipeline(profile, devices, micro_batches=m,
                                     micro_batch_size=math.ceil(global_batch / m), **common)
                h = HybridSplit(sizes=one.sizes, replicas=(one,), shares=(global_batch,),
                                global_batch=global_batch)
            else:
                h = split_hybrid(profile, devices, stages=stages, global_batch=global_batch,
                                 micro_batches=m, **common)
        except UsageError as e:
            cands.append(Candidate(name=name, kind=kind, fits=False, samples_per_s=0.0, detail=e.what,
                                   replicas=d, stages=stages))
            continue
        sync = 0.0
        if d > 1:
            sync = _allreduce_seconds(max(st.state_bytes / state_factor for st in h.replicas[0].stages),
                                      d, link_bytes_per_s)
        rate = global_batch / max(h.step_seconds + sync, _EPS)
        rep = h.replicas[0]
        cands.append(Candidate(
            name=name, kind=kind, fits=True, samples_per_s=rate, replicas=d, stages=stages, sizes=h.sizes,
            shares=h.shares,
            detail=(f"blocks per stage {'/'.join(map(str, h.sizes))}, {m} micro-batches ({schedule}), bubble "
                    f"{rep.bubble_fraction:.0%}" + (f", replica shares {'/'.join(map(str, h.shares))}" if d > 1 else "")
                    + f", largest stage {_gib(max(st.memory_bytes for r in h.replicas for st in r.stages))}")))
    fitting = [c for c in cands if c.fits]
    if not fitting:
        raise UsageError("no layout fits memory: " + "; ".join(f"{c.name}: {c.detail}" for c in cands),
                         "try activation checkpointing, sharding parameters and optimizer state (FSDP), "
                         "smaller micro-batches, or devices with more memory")
    fastest = max(fitting, key=lambda c: c.samples_per_s)
    order = {"dp": 0, "pp": 1, "dp×pp": 2}
    choice = min((c for c in fitting if c.samples_per_s >= fastest.samples_per_s * (1 - prefer_simpler_within)),
                 key=lambda c: (order[c.kind], c.stages, -c.samples_per_s))
    others = [c for c in cands if c is not choice]
    why = [f"{choice.samples_per_s:.1f} samples/s predicted"]
    if choice is not fastest:
        why.append(f"within {prefer_simpler_within:.0%} of the fastest ({fastest.name}, "
                   f"{fastest.samples_per_s:.1f}) and simpler")
    else:
        beaten = [f"{c.name} {c.samples_per_s:.1f}" for c in others if c.fits]
        if beaten:
            why.append("faster than " + ", ".join(beaten))
    missing = [c.name for c in others if not c.fits]
    if missing:
        why.append(f"{', '.join(missing)} do{'es' if len(missing) == 1 else ''} not fit memory")
    return ParallelismChoice(choice=choice, reason="; ".join(why), candidates=tuple(cands))
