"""Which layout for a model on a mixed cluster: DP, PP, or DP × PP (pure; no torch).

DP × PP. D pipeline replicas of p stages; replica r holds devices [r·p, (r+1)·p) — the rank layout
of a (dp, pp) mesh. All replicas use one split of the blocks, because data parallelism averages
the gradients of the same blocks stage by stage. On a mixed machine the replicas differ in
speed, so replica r computes a share of each global batch in proportion to its pipeline's
throughput (1 / its slowest stage): data parallelism's hetero shares, applied to whole pipelines.

The choice. `compare_parallelism` predicts data parallelism (every device holds the whole model,
shares by speed, plus a ring all-reduce of the gradients when a link is given: collectives.py),
one pipeline over every device, and every DP×PP layout, and picks the fastest that fits
memory — or a simpler one within a few percent of it — with the reason.

Tensor parallelism is not a candidate here: it splits every layer evenly, so on mixed devices each
rank waits for the slowest; it belongs inside a group of equal devices (parallel/tensor.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import UsageError
from ..hardware.units import compact, format_bytes as _gib
from .collectives import FREE_LINK, Link, allreduce_seconds
from .memory import ADAMW_STATE_FACTOR
from .hybrid_search import batch_error, best_split, renamed, replica_kinds, shares_error
from ..runtime.layouts.pipeline.split import (PipelineProfile, PipelineSplit, StageCosts, StageDevice, evaluate_split,
                             micro_batch_cut, split_pipeline)
from .shares import proportional_shares

_EPS = 1e-12


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
                    schedule: str = "1f1b", state_factor: float = ADAMW_STATE_FACTOR, memory_margin: float = 0.10,
                    link: Link | None = None) -> HybridSplit:
    """DP×PP with a given split: replica r holds devices [r·p, (r+1)·p) (the rank layout of a
    (dp, pp) mesh) and computes `shares[r]` samples per step — by default in proportion to its
    pipeline's throughput (1 / its slowest stage), the hetero shares of data parallelism applied
    to whole pipelines. Each replica runs `micro_batches` micro-batches of ceil(share / m).

    Replicas of one kind (the same speed and memory at every stage position) are costed once per
    micro-batch size: O(W + K·(n + p)) for W devices, K kinds, n blocks, p stages."""
    groups = _replica_groups(devices, stages)
    d = len(groups)
    kinds, kind_of = replica_kinds(groups)
    common = dict(schedule=schedule, micro_batches=micro_batches, state_factor=state_factor,
                  memory_margin=memory_margin, link=link)
    if shares is None:
        if (error := batch_error(global_batch, d, micro_batches)) is not None:
            raise error
        per_sample = [evaluate_split(profile, g, sizes, micro_batch_size=1, **common) for g in kinds]
        speeds = [1.0 / max(per_sample[k].bottleneck.seconds_per_micro, _EPS) for k in kind_of]
        shares = proportional_shares(global_batch, speeds)
        how = "in proportion to each pipeline's throughput (its slowest stage)"
    else:
        shares = tuple(int(b) for b in shares)
        how = "given"
    if len(shares) != d or sum(shares) != global_batch or min(shares) < micro_batches:
        raise shares_error(shares, d, global_batch, micro_batches)
    costed: dict[tuple[int, int], PipelineSplit] = {}      # (kind, micro-batch size) -> its split
    reps = []
    for g, k, b in zip(groups, kind_of, shares):
        mu, n = micro_batch_cut(b, micro_batches, stages=stages, schedule=schedule)    # as the runtime cuts it
        if (k, mu, n) not in costed:
            costed[(k, mu, n)] = evaluate_split(profile, g, sizes, micro_batch_size=mu,
                                                **{**common, "micro_batches": n})
        reps.append(renamed(costed[(k, mu, n)], g))
    reasons = (f"{d} replicas × {stages} stages, blocks per stage {'/'.join(map(str, reps[0].sizes))} "
               "in every replica (data parallelism averages the same blocks stage by stage)",
               f"replica shares {compact(shares)} of {global_batch}: {how}")
    return HybridSplit(sizes=reps[0].sizes, replicas=tuple(reps), shares=tuple(shares), global_batch=global_batch,
                       reasons=reasons)


def split_hybrid(profile: PipelineProfile, devices: Sequence[StageDevice], *, stages: int, global_batch: int,
                 micro_batches: int, schedule: str = "1f1b", state_factor: float = ADAMW_STATE_FACTOR,
                 memory_margin: float = 0.10, link: Link | None = None,
                 max_candidates: int = 20_000) -> HybridSplit:
    """The common split for DP×PP (see `evaluate_hybrid`) that maximises the replicas' total
    throughput, every stage fitting its device at its replica's micro-batch size. All replicas
    use one split because data parallelism averages the gradients of the same blocks stage by
    stage. Candidates: every composition of the n blocks into p stages when there are at most
    `max_candidates` of them (C = C(n−1, p−1)), else the min-max split for the slowest device at
    each stage position (C = 1, after an O(p·n²) split). The first candidate, in order, that fits
    and beats the best before it by more than 1e-9 is kept.

    Complexity: O(W + C·K·p) for W devices in D = W/p replicas of K kinds (replicas with the same
    speed and memory at every stage position cost the same: planning/hybrid_search.py), plus a
    share solve, O(K·log B + D·log D), for each candidate that a lower bound on its step cannot
    rule out — the shares, and the answer, are those of evaluating every candidate in full."""
    groups = _replica_groups(devices, stages)
    d, n = len(groups), profile.n_blocks
    common = dict(stages=stages, global_batch=global_batch, micro_batches=micro_batches, schedule=schedule,
                  state_factor=state_factor, memory_margin=memory_margin, link=link)
    if stages > n:    # says why, and what to try
        split_pipeline(profile, groups[0], micro_batches=micro_batches, micro_batch_size=1, schedule=schedule)
    if math.comb(n - 1, stages - 1) <= max_candidates:
        candidates = _compositions(n, stages)
    else:   # too many to try: split for the slowest device at each stage position, then evaluate
        weakest = [StageDevice(name=f"stage {s}", speed=min(g[s].speed for g in groups),
                               memory_bytes=min((g[s].memory_bytes for g in groups if g[s].memory_bytes),
                                                default=None)) for s in range(stages)]
        candidates = [split_pipeline(profile, weakest, micro_batches=micro_batches,
                                     micro_batch_size=math.ceil(global_batch / d / micro_batches),
                                     schedule=schedule, state_factor=state_factor, memory_margin=memory_margin,
                                     link=link).sizes]
    if (error := batch_error(global_batch, d, micro_batches)) is not None:
        raise error
    costs = StageCosts.make(profile, groups[0], schedule=schedule, micro_batches=micro_batches, micro_batch_size=1,
                            state_factor=state_factor, memory_margin=memory_margin, link=link)
    sizes = best_split(costs, groups, candidates, global_batch=global_batch)
    if sizes is None:
        micro = math.ceil(global_batch / d / micro_batches)
        kinds, _ = replica_kinds(groups)
        for g in kinds:     # a replica that cannot fit on its own explains best (one of each kind)
            try:
                split_pipeline(profile, g, micro_batches=micro_batches, micro_batch_size=micro, schedule=schedule,
                               state_factor=state_factor, memory_margin=memory_margin, link=link)
            except UsageError as e:
                raise UsageError(f"DP×PP {d}×{stages}: {e.what}", e.fix) from None
        raise UsageError(f"DP×PP {d}×{stages}: no common split fits every replica's memory",
                         "try more micro-batches, activation checkpointing, or sharding (FSDP)")
    best = evaluate_hybrid(profile, devices, sizes, **common)
    details = tuple(f"replica {r}: " + line for r, rep in enumerate(best.replicas) for line in rep.describe())
    return HybridSplit(sizes=best.sizes, replicas=best.replicas, shares=best.shares, global_batch=global_batch,
                       reasons=best.reasons + details + (f"block costs {profile.source}",))


def _compositions(n: int, k: int):
    """Every way to write n as k positive parts, in lexicographic order (cut points 0 < c_1 < … < n)."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield tuple(edges[i + 1] - edges[i] for i in range(k))


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
    memory: tuple[float, ...] = ()     # PP, DP×PP: peak bytes per device, in rank order
    sync_s: float = 0.0                # PP, DP×PP: the stages' gradient all-reduce over the replicas
    split: HybridSplit | None = None   # PP, DP×PP: the replicas' splits it was costed from


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


def _dp_candidate(profile, devices, *, global_batch, state_factor, memory_margin, link: Link,
                  grad_fraction: float = 1.0) -> Candidate:
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
    sync = allreduce_seconds(len(devices), grad_fraction * profile.param_bytes, link)
    return Candidate(name="DP" if len(devices) > 1 else "one device", kind="dp", fits=True,
                     samples_per_s=global_batch / max(compute + sync, _EPS), replicas=len(devices),
                     shares=shares,
                     detail=f"every device holds the whole model ({_gib(state)} with gradients and optimizer); "
                            f"shares {compact(shares)} by speed"
                            + (f"; gradient all-reduce {sync * 1e3:.3g} ms" if sync else ""))


def compare_parallelism(profile: PipelineProfile, devices: Sequence[StageDevice], *, global_batch: int,
                        micro_batches: int = 8, schedule: str = "1f1b", state_factor: float = ADAMW_STATE_FACTOR,
                        memory_margin: float = 0.10, link: Link | None = None,
                        prefer_simpler_within: float = 0.05, grad_fraction: float = 1.0,
                        require_fit: bool = True) -> ParallelismChoice:
    """Predict data parallelism (every device holds the model, hetero shares), one pipeline over all
    devices, and every DP×PP layout (replicas of p consecutive devices, p dividing the device
    count), then pick the fastest that fits memory. A simpler layout (DP, then PP, then DP×PP) wins
    when it is within `prefer_simpler_within` of the fastest: fewer moving parts for the same speed.
    Fine-tuning: `grad_fraction` of each block's parameter bytes have gradients to all-reduce
    (the trainable part; its memory is in `state_factor`). `require_fit=False`: when nothing
    fits, return every candidate (the choice is the first, not fitting) instead of raising.

    Raises UsageError when nothing fits, with each candidate's reason and what to try.

    Complexity, for W devices and n blocks: DP is one share solve, O(W + K·log B); each divisor p
    of W with p <= n is one `split_hybrid`, O(W + C_p·K_p·p) plus its share solves, where
    C_p = C(n−1, p−1) compositions when at most `max_candidates` (20,000), else 1 after an O(p·n²)
    min-max split, and K_p the distinct replica kinds (p > n is rejected at once); one pipeline
    over all W devices (W <= n) is O(W·n²). In all O(Σ_p (W + C_p·K_p·p)) plus the share solves
    the search's bound does not rule out: about 0.2 s for 1,024 devices of a few models in nodes
    of 8 and 24 blocks (benchmarks/plan_scale.py)."""
    w = len(devices)
    if w < 1:
        raise UsageError("no devices to compare layouts on", "give at least one device")
    if global_batch < 1:
        raise UsageError(f"global batch {global_batch}", "use a positive global batch")
    link = FREE_LINK if link is None else link
    common = dict(schedule=schedule, state_factor=state_factor, memory_margin=memory_margin, link=link)
    cands = [_dp_candidate(profile, devices, global_batch=global_batch, state_factor=state_factor,
                           memory_margin=memory_margin, link=link, grad_fraction=grad_fraction)]
    for stages in range(2, w + 1):
        if w % stages:
            continue
        d = w // stages
        name = f"PP {stages} stages" if d == 1 else f"DP×PP {d}×{stages}"
        kind = "pp" if d == 1 else "dp×pp"
        m = micro_batches if schedule == "gpipe" else max(micro_batches, stages)
        m = min(m, max(1, global_batch // d))        # at least one sample per micro-batch
        try:
            if d == 1:   # one pipeline: the min-max split the runtime uses, which sizes its stages
                # without a link (a pipeline job measures none), then costed with its sends: on a
                # near tie the sends alone chose another split (2/2 against the runtime's 3/1) whose
                # memory was not the memory of the run
                mu, n = micro_batch_cut(global_batch, m, stages=stages, schedule=schedule)
                one = split_pipeline(profile, devices, micro_batches=n, micro_batch_size=mu,
                                     **{**common, "link": FREE_LINK})
                one = evaluate_split(profile, devices, one.sizes, micro_batches=n, micro_batch_size=mu, **common)
                h = HybridSplit(sizes=one.sizes, replicas=(one,), shares=(global_batch,),
                                global_batch=global_batch)
            else:
                h = split_hybrid(profile, devices, stages=stages, global_batch=global_batch,
                                 micro_batches=m, **common)
        except UsageError as e:
            cands.append(Candidate(name=name, kind=kind, fits=False, samples_per_s=0.0, detail=e.what,
                                   replicas=d, stages=stages))
            continue
        # Each stage all-reduces its gradients (as many bytes as its parameters) over the d replicas.
        sync = allreduce_seconds(d, grad_fraction * max(st.param_bytes for st in h.replicas[0].stages), link)
        rate = global_batch / max(h.step_seconds + sync, _EPS)
        rep = h.replicas[0]
        cands.append(Candidate(
            name=name, kind=kind, fits=True, samples_per_s=rate, replicas=d, stages=stages, sizes=h.sizes,
            shares=h.shares, memory=tuple(st.memory_bytes for r in h.replicas for st in r.stages), sync_s=sync,
            split=h,
            detail=(f"blocks per stage {'/'.join(map(str, h.sizes))}, micro-batches "
                    f"{compact(f'{r.micro_batch_size}x{r.micro_batches}' for r in h.replicas)} ({schedule}), bubble "
                    f"{rep.bubble_fraction:.0%}" + (f", replica shares {compact(h.shares)}" if d > 1 else "")
                    + f", largest stage {_gib(max(st.memory_bytes for r in h.replicas for st in r.stages))}")))
    fitting = [c for c in cands if c.fits]
    if not fitting and not require_fit:
        return ParallelismChoice(choice=cands[0], reason="no layout fits memory", candidates=tuple(cands))
    if not fitting:
        raise UsageError("no layout fits memory: " + "; ".join(f"{c.name}: {c.detail}" for c in cands),
                         "try activation checkpointing, sharding parameters and optimizer state (FSDP), "
                         "smaller micro-batches, or devices with more memory")
    from .chooser import simplest_within

    fastest = max(fitting, key=lambda c: c.samples_per_s)
    order = {"dp": 0, "pp": 1, "dp×pp": 2}
    choice = simplest_within(fitting, prefer_simpler_within, simpler=lambda c: (order[c.kind], c.stages))   # the chooser's rule
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


def with_fixed_cost(c, fastest, *, global_batch: int, micro_batches: int, schedule: str):
    """A pipeline candidate with each micro-batch's fixed cost added (compare_parallelism's block
    costs are per sample only). A micro-batch of µ samples costs a + b·µ (the profile's fit), and
    a stage runs every micro-batch's forward and backward pieces, so each stage pays a fixed part
    per micro-batch that does not shrink with µ: with uniform blocks it is spread over them like
    the per-sample part, so every stage's micro-batch time, and the fill-drain step, grows by the
    factor 1 + a/(b·µ). µ is the replica's micro-batch (share / m, as the runtime cuts it); with
    replicas of different shares the smallest µ (the largest factor) is kept: the slowest replica
    sets the step. The replicas' gradient all-reduce is not stretched. `fastest`: the fastest device's
    DeviceProfile (planning/profile.py)."""
    if c.kind == "dp" or not c.fits or not fastest.per_sample_s > 0:
        return c
    d = max(c.replicas, 1)
    m = micro_batches if schedule == "gpipe" else max(micro_batches, c.stages)
    m = min(m, max(1, global_batch // d))            # as compare_parallelism caps it
    mu = micro_batch_cut(min(c.shares or (global_batch,)), m, stages=c.stages, schedule=schedule)[0]
    grow = 1 + fastest.overhead_s / (fastest.per_sample_s * mu)
    step = global_batch / c.samples_per_s - c.sync_s
    return replace(c, samples_per_s=global_batch / (step * grow + c.sync_s))


def with_step_work(c, profiles, o):
    """A pipeline candidate with what every step adds after its schedule, as the DP rows have it:
    each stage's optimizer step over its parameters (its device's measured optimizer seconds, a
    whole model's, times the stage's part of the parameters; the next step's first forward waits
    for the slowest) and hetrain's agreement all-reduce. `profiles`: the devices' DeviceProfiles in
    rank order; `o`: the PlanOptions (its agree_s, global_batch)."""
    if not c.fits or c.split is None:
        return c
    total = sum(st.param_bytes for st in c.split.replicas[0].stages)
    if total <= 0:
        return c
    p = c.stages
    opt = max(profiles[r * p + s].optimizer_s * st.param_bytes / total
              for r, rep in enumerate(c.split.replicas) for s, st in enumerate(rep.stages))
    extra = opt + o.agree_s
    if not extra > 0 or not c.samples_per_s > 0:
        return c
    return replace(c, samples_per_s=o.global_batch / (o.global_batch / c.samples_per_s + extra))


def on_host(c: Candidate, host, pipeline: PipelineProfile | None = None) -> Candidate:
    """Candidate `c` as it runs on what its devices share (DeviceProfile.host, which plays a
    pipeline's step out: its `pipeline` method); unchanged with none."""
    return c if host is None else host.pipeline(c, pipeline)


def stage_rows(profile: PipelineProfile, devices: Sequence[StageDevice], o, *, micro_batches, schedule: str,
               state_factor: float, host=None) -> list:
    """Every DP×PP shape of these devices as ranking rows (planning/ranking.LayoutRow), for
    Pipeline(stages='auto') to choose from with the chooser: replicas of p stages (p divides the
    devices, at most half of them and at most the blocks), split as the runtime splits them
    (split_hybrid at `micro_batches(p)` micro-batches), what the devices share (`host`: as
    DeviceProfile.host) counted as the ranking counts it (`on_host`)."""
    from ..layout_spec import Pipeline, to_spec
    from .rows import LayoutRow

    w, rows = len(devices), []
    for p in range(2, w // 2 + 1):
        if w % p or p > profile.n_blocks:
            continue
        name, spec = f"DP×PP {w // p}×{p}", to_spec(Pipeline(stages=p))
        try:
            h = split_hybrid(profile, devices, stages=p, global_batch=o.global_batch, micro_batches=micro_batches(p),
                             schedule=schedule, state_factor=state_factor, memory_margin=o.memory_margin)
        except UsageError as e:
            rows.append(LayoutRow(name=name, family="DP×PP", fits=False, samples_per_s=0.0, memory=(None,) * w,
                                  comm_bytes=0.0, comm_s=0.0, detail=e.what, run="", stages=p, spec=spec))
            continue
        c = on_host(Candidate(name=name, kind="dp×pp", fits=True, samples_per_s=h.samples_per_s,
                              detail=f"blocks per stage {'/'.join(map(str, h.sizes))}", replicas=w // p,
                              stages=p, split=h), host, profile)
        rows.append(LayoutRow(name=name, family="DP×PP", fits=True, samples_per_s=c.samples_per_s,
                              memory=tuple(st.memory_bytes for r in h.replicas for st in r.stages), comm_bytes=0.0,
                              comm_s=0.0, detail=c.detail, run="", stages=p, spec=spec))
    return rows
