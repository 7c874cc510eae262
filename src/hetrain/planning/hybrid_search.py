"""The DP×PP search behind planning/parallelism.py `split_hybrid`: the same answer, cheaper (pure).

split_hybrid tries candidate splits (blocks per stage) in order and keeps the first that fits
every replica and beats the best so far by more than a relative 1e-9. Evaluated in full, each
candidate costs a per-sample pass over the D replicas (their throughputs), the replicas' shares
of the global batch B (a solve over D), and a pass at each replica's micro-batch size: O(D·p).
Three things make it cheap without changing what is chosen:

  * Kinds. Replicas whose devices have the same speed and memory at every stage position have
    the same costs: each of the K distinct kinds is costed once and counted as often as it occurs
    (1,024 devices of a few models over nodes of 8 make a handful of kinds).
  * A bound. Shares are the B earliest-ending samples (shares.py), so a replica of throughput
    v_r gets at least B·v_r/Σv − 1 samples, hence at least that micro-batch size; a stage's time
    and memory only grow with the micro-batch size. Each kind at its least micro-batch size
    bounds the step from below — with the float arithmetic of the full evaluation (StageCosts),
    which rounding keeps monotone — so a candidate whose bound cannot beat the best so far by the
    margin, or cannot fit memory, is skipped without solving its shares.
  * The shares check (every replica at least m samples: split_hybrid raises at the first
    candidate that fails it) is decided by the same bound; the shares are solved only when the
    bound cannot tell, or the candidate could win, and once per distinct set of kind speeds.

Cost: O(C·K·p) for C candidates, plus O(K·log B + D·log D) per share solve (few: see above).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from ..errors import UsageError
from ..hardware.units import compact
from ..runtime.layouts.pipeline.split import PipelineSplit, StageCosts, StageDevice, micro_batch_cut
from .shares import proportional_shares

_EPS = 1e-12
BETTER = 1 + 1e-9        # how much faster a later candidate must be to replace the best
_SLACK = 1e-9            # relative slack on the share bound, far above float rounding (~1e-16)


def batch_error(global_batch: int, d: int, m: int) -> UsageError | None:
    """Why `global_batch` cannot give d replicas m micro-batches each (None: it can)."""
    if global_batch >= d * m:
        return None
    return UsageError(f"global batch {global_batch} cannot give {d} replicas {m} micro-batches each",
                      f"use a global batch of at least {d * m}, or fewer micro-batches")


def shares_error(shares: Sequence[int], d: int, global_batch: int, m: int) -> UsageError:
    """Replica shares that do not give each of d replicas m micro-batches of the global batch."""
    return UsageError(f"replica shares [{compact(shares, sep=', ')}] for {d} replicas, global batch {global_batch}, "
                      f"{m} micro-batches", f"give {d} shares of at least {m} that sum to {global_batch}")


def replica_kinds(groups: Sequence[Sequence[StageDevice]]) -> tuple[list[Sequence[StageDevice]], list[int]]:
    """Replicas with the same (speed, memory) at every stage position are one kind: (the first
    replica of each kind, each replica's kind). O(D·p)."""
    index: dict[tuple, int] = {}
    first: list[Sequence[StageDevice]] = []
    kind_of = []
    for g in groups:
        key = tuple((dv.speed, dv.memory_bytes) for dv in g)
        if key not in index:
            index[key] = len(first)
            first.append(g)
        kind_of.append(index[key])
    return first, kind_of


def renamed(split: PipelineSplit, devices: Sequence[StageDevice]) -> PipelineSplit:
    """A replica's split from another replica of its kind (same numbers, its own device names)."""
    if all(st.device == dv.name for st, dv in zip(split.stages, devices)):
        return split
    return dataclasses.replace(split, stages=tuple(dataclasses.replace(st, device=dv.name)
                                                   for st, dv in zip(split.stages, devices)))


class _Search:
    """The costs of one DP×PP layout's replicas, by kind, for any split and micro-batch size."""

    def __init__(self, costs: StageCosts, groups: Sequence[Sequence[StageDevice]], global_batch: int):
        self.costs, self.batch = costs, global_batch
        self.kinds, self.kind_of = replica_kinds(groups)
        self.count = [0] * len(self.kinds)
        for k in self.kind_of:
            self.count[k] += 1
        p = costs.p
        self.caps = [[costs.cap(g[s].memory_bytes) for s in range(p)] for g in self.kinds]
        self.order = list(range(len(self.kinds)))    # the kind that ruled out the last candidate first
        self.stages: dict[tuple[int, int, int], tuple[tuple[float, float, float], tuple[float, ...]]] = {}
        self.solved: dict[tuple[float, ...], tuple[tuple[int, ...], list[int], set[tuple[int, int]]]] = {}

    def rows(self, sizes: Sequence[int]) -> list[tuple[tuple[float, float, float], tuple[float, ...]]]:
        """Per stage: its totals (StageCosts.totals) and each kind's seconds per micro-batch of 1."""
        edges = (0, *itertools.accumulate(sizes))
        out = []
        for s in range(len(sizes)):
            key = (s, edges[s], edges[s + 1])
            if key not in self.stages:
                tot = (*self.costs.totals(*key), key[2] - key[1])      # + the stage's block count
                self.stages[key] = tot, tuple(self.costs.seconds_per_micro(s, tot[0], g[s].speed, 1, blocks=tot[3])
                                              for g in self.kinds)
            out.append(self.stages[key])
        return out

    @staticmethod
    def speeds(rows) -> tuple[float, ...]:
        """Each kind's samples/s at micro-batch 1 (1 / its slowest stage): evaluate_hybrid's
        per-sample pass."""
        return tuple(1.0 / max(max(col), _EPS) for col in zip(*(r[1] for r in rows)))

    def step(self, k: int, rows, mu: int, n: int) -> tuple[float, bool]:
        """Kind k's step seconds at n micro-batches of mu (PipelineSplit.step_seconds), and whether
        every stage fits (StagePlan.fits)."""
        c, g, caps = self.costs, self.kinds[k], self.caps[k]
        ts = [c.seconds_per_micro(s, tot[0], g[s].speed, mu, blocks=tot[3]) for s, (tot, _) in enumerate(rows)]
        fits = True
        for s, (tot, _) in enumerate(rows):
            if caps[s] is not None:
                _, state, acts = c.memory(s, tot[1], tot[2], mu, n)
                if not state + acts <= caps[s]:
                    fits = False
                    break
        return sum(ts) + (n - 1) * max(ts), fits

    def cut(self, share: int) -> tuple[int, int]:
        """(µ, n) of a replica with this share (pipeline_split.micro_batch_cut, as evaluate_hybrid)."""
        c = self.costs
        return micro_batch_cut(share, c.micro_batches, stages=c.p, schedule=c.schedule)

    def least_cut(self, least: int) -> tuple[int, int]:
        """A (µ, n) at or below the cut of every share b >= least (time and memory grow with both).
        µ = ⌈b/m⌉ >= ⌈least/m⌉, or (1F1B's floor) ⌊b/p⌋ >= ⌊least/p⌋. n = ⌈b/µ⌉ > b·m/(b+m) >=
        least·m/(least+m) as µ < b/m + 1, so n >= ⌊least·m/(least+m)⌋ + 1; under 1F1B n >= p
        as well (the floor applies only where the first cut gave fewer, and then gives more)."""
        c = self.costs
        m, p = c.micro_batches, c.p
        mu = max(1, min(-(-least // m), least // p)) if c.schedule == "1f1b" else max(1, -(-least // m))
        n = max(1, min(m, (m * least) // (least + m) + 1))
        return mu, (max(n, p) if c.schedule == "1f1b" else n)

    def ruled_out(self, rows, least: Sequence[int], beat: float | None) -> bool:
        """Whether some kind, at the cut below that of its least share (least_cut), does not fit or
        leaves the step too long to give more than `beat` samples/s (then every replica of it does:
        time and memory only grow with the micro-batch size and count). B / max(max_k step_k, ε) is
        the least of B / max(step_k, ε), so one kind decides."""
        for i, k in enumerate(self.order):
            step, fits = self.step(k, rows, *self.least_cut(least[k]))
            if not fits or (beat is not None and self.batch / max(step, _EPS) <= beat):
                self.order.insert(0, self.order.pop(i))
                return True
        return False

    def shares(self, speeds: tuple[float, ...]) -> tuple[tuple[int, ...], list[int], set[tuple[int, int]]]:
        """The replicas' shares for these kind speeds (evaluate_hybrid's), each kind's least share,
        and the distinct (kind, share) pairs; solved once per distinct speeds."""
        if speeds not in self.solved:
            shares = proportional_shares(self.batch, [speeds[k] for k in self.kind_of])
            pairs = set(zip(self.kind_of, shares))
            least = [self.batch] * len(self.kinds)
            for k, b in pairs:
                least[k] = min(least[k], b)
            self.solved[speeds] = shares, least, pairs
        return self.solved[speeds]


def best_split(costs: StageCosts, groups: Sequence[Sequence[StageDevice]], candidates: Iterable[Sequence[int]], *,
               global_batch: int) -> tuple[int, ...] | None:
    """The split split_hybrid keeps (see the module docstring): the first candidate, in order,
    that fits every replica and is faster than the best before it by more than BETTER; None when
    none fits. `costs` is set up for the replicas' stage count and micro-batches. Raises
    split_hybrid's UsageError at the first candidate whose shares give a replica fewer than m."""
    search = _Search(costs, groups, global_batch)
    m, B, d = costs.micro_batches, global_batch, len(groups)
    best_rate, best = None, None
    for sizes in candidates:
        rows = search.rows(sizes)
        speeds = search.speeds(rows)
        total = sum(n * v for n, v in zip(search.count, speeds))
        # Each replica's share is at least B·v/Σv − 1 (module docstring), less a slack for rounding.
        least = [max(0, math.floor(B * v / total * (1 - _SLACK)) - 1) for v in speeds]
        if min(least) < m:              # the bound cannot tell: the shares decide
            shares, least, _ = search.shares(speeds)
            if min(least) < m:
                raise shares_error(shares, d, B, m)
        if search.ruled_out(rows, least, None if best_rate is None else best_rate * BETTER):
            continue
        _, _, pairs = search.shares(speeds)
        steps = [search.step(k, rows, *cut) for k, cut in {(k, search.cut(b)) for k, b in pairs}]
        if not all(fits for _, fits in steps):
            continue
        rate = B / max(max(t for t, _ in steps), _EPS)
        if best_rate is None or rate > best_rate * BETTER:
            best_rate, best = rate, tuple(sizes)
    return best
