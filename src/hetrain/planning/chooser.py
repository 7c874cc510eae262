"""Which layout runs: the one rule behind prepare(parallel='auto'), `hetrain plan`, `hetrain
simulate`, Pipeline(stages='auto') and sharding='auto' (pure: no torch).

    auto runs the fastest row that fits and that the request allows, or a simpler one
    (ranking.ORDER) within `within` (5%) of it: fewer collectives for the same speed.

The request (`Request`) allows:
  * an explicit layout object: that layout, whatever the ranking prefers (never overridden; the
    reason says what auto would have run instead);
  * `families`: a constraint (the DP family for sharding='auto', DP×PP for Pipeline(stages='auto'));
  * pipelines only with a loss function: their schedule computes the loss on the last stage;
  * with in-loop OOM recovery asked for (Memory.oom_recovery, the default), only the layouts that
    keep it: capacity-full (sharding/wrap.py) and tensor parallelism (runtime/layouts/tensor/loop.py)
    turn it off, so auto runs them only with oom_recovery=False (or when asked for by name).
    Restarts from checkpoints hold under every layout, so they rule nothing out.
A row the request leaves out is said in one line (`Choice.left_out`) when it fits, so a faster
layout never disappears silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..hardware.units import device_kinds
from ..layout_spec import to_spec
from .rows import ORDER, LayoutRow, seconds

PIPELINES = ("PP", "DP×PP")
NO_OOM_RECOVERY = ("capacity-full", "TP", "TP by speed")     # an OOM there ends the attempt
PREFER_SIMPLER_WITHIN = 0.05


@dataclass(frozen=True, kw_only=True)
class Request:
    layout: object | None = None               # an explicit layout object: runs as asked
    families: tuple[str, ...] | None = None    # only these (ranking.ORDER); None: every one
    has_loss_fn: bool = True                   # without it no pipeline can run
    oom_recovery: bool = True                  # the job keeps in-loop OOM recovery on
    within: float = PREFER_SIMPLER_WITHIN      # a simpler row this close to the fastest wins

    def __post_init__(self):
        from ..errors import UsageError

        unknown = [f for f in self.families or () if f not in ORDER]
        if unknown:
            raise UsageError(f"layout families {unknown} are not ranked", f"use some of {', '.join(ORDER)}")
        if not 0 <= self.within < 1:
            raise UsageError(f"prefer a simpler layout within {self.within!r}", "use a fraction in [0, 1), e.g. 0.05")


AUTO = Request()


@dataclass(frozen=True, kw_only=True)
class Choice:
    row: LayoutRow | None          # the row chosen (None: nothing allowed fits, or an explicit layout without a row)
    spec: dict | None              # what runs: layout_spec.to_spec of its layout object
    why: str
    left_out: tuple[str, ...] = ()     # one line per reason the request left fitting rows out


def excluded(row: LayoutRow, request: Request) -> str | None:
    """Why the request leaves `row` out (None: allowed)."""
    if request.families is not None and row.family not in request.families:
        return "not asked for"
    if row.family in PIPELINES and not request.has_loss_fn:
        return "no loss_fn: a pipeline's schedule computes the loss on the last stage (pass loss_fn= to ht.prepare())"
    if row.family in NO_OOM_RECOVERY and request.oom_recovery:
        return ("it turns in-loop OOM recovery off, which this job keeps on "
                "(Memory(oom_recovery=False) lets auto run it, or ask for it by name)")
    return None


def simplest_within(items: Sequence, within: float, *, simpler, speed=lambda r: r.samples_per_s):
    """Of `items` (all fitting), the simplest (`simpler`: a sort key, smaller is simpler) whose
    speed is within `within` of the fastest's."""
    top = max(speed(r) for r in items)
    return min((r for r in items if speed(r) >= top * (1 - within)), key=lambda r: (simpler(r), -speed(r)))


def simplest_near_fastest(fitting: Sequence[LayoutRow], within: float) -> LayoutRow:
    """Of the rows that fit, the simplest (ORDER) within `within` of the fastest's samples/s."""
    return simplest_within(fitting, within, simpler=lambda r: ORDER.index(r.family))


def choose(rows: Sequence[LayoutRow], request: Request = AUTO) -> Choice:
    """The row that runs for `request` among the ranked `rows`, and why (see the module docstring)."""
    if request.layout is not None:
        spec = to_spec(request.layout)
        auto = choose(rows, replace(request, layout=None))
        why = f"{request.layout!r} asked for by name: it runs as asked"
        if auto.row is not None and auto.row.spec != spec:
            why += f" (auto would run {auto.row.name}, {auto.row.samples_per_s:.1f} samples/s predicted)"
        return Choice(row=next((r for r in rows if r.spec == spec), None), spec=spec, why=why)
    fitting = sorted((r for r in rows if r.fits and excluded(r, request) is None), key=lambda r: -r.samples_per_s)
    best = simplest_near_fastest(fitting, request.within) if fitting else None
    reasons: dict[str, list[LayoutRow]] = {}
    for r in rows:
        reason = excluded(r, request)
        if r.fits and reason is not None and reason != "not asked for":
            reasons.setdefault(reason, []).append(r)
    # Said: the pipelines a missing loss_fn rules out, and any row left out that would have won.
    left_out = tuple(f"{', '.join(r.name for r in left)} left out: {reason}" for reason, left in reasons.items()
                     if best is None or any(r.family in PIPELINES or r.samples_per_s > best.samples_per_s
                                            for r in left))
    if best is None:
        why = ("no layout fits memory" if not any(r.fits for r in rows) else
               "only layouts left out fit memory (" + "; ".join(left_out) + ")" if left_out else
               "none of the layouts asked for fits memory")
        return Choice(row=None, spec=None, why=why, left_out=left_out)
    return Choice(row=best, spec=best.spec, why=_why(best, fitting, rows, request), left_out=left_out)


def _why(best: LayoutRow, fitting: list[LayoutRow], rows: Sequence[LayoutRow], request: Request) -> str:
    fastest = fitting[0]
    why = [f"{best.name}: {best.samples_per_s:.1f} samples/s predicted"]
    if best is not fastest:
        why.append(f"within {request.within:.0%} of the fastest ({fastest.name}, "
                   f"{fastest.samples_per_s:.1f}) with fewer collectives")
    else:
        runner = next((r for r in fitting if r is not best), None)
        if runner is not None:
            why.append(f"{best.samples_per_s / runner.samples_per_s:.2f}× the next ({runner.name}, "
                       f"{runner.samples_per_s:.1f})" + because(best, runner))
    considered = [r for r in rows if request.families is None or r.family in request.families]
    dp = next((r for r in considered if r.family == "DP"), None)
    if dp is not None and not dp.fits:
        why.append(f"plain DP does not fit ({dp.detail})")
    others = [r for r in considered if not r.fits and r is not dp]
    if others:
        why.append(f"{', '.join(r.name for r in others)} do{'es' if len(others) == 1 else ''} not fit memory")
    faster = [r for r in rows if r.fits and r.samples_per_s > best.samples_per_s and excluded(r, request)
              not in (None, "not asked for")]
    if faster:
        top = max(faster, key=lambda r: r.samples_per_s)
        why.append(f"{top.name} predicts {top.samples_per_s:.1f} but is left out")
    return "; ".join(why)


def because(best: LayoutRow, runner: LayoutRow) -> str:
    """One reason the winner beats the runner-up, from what they predict."""
    if runner.samples_per_s >= best.samples_per_s * 0.99:
        return f": {runner.name} predicts the same within 1%, {best.name} has fewer collectives"
    if runner.family == "TP":
        return ": TP runs every device at the slowest one's speed"
    if runner.comm_s > best.comm_s + 1e-9 and (runner.comm_s - best.comm_s) * runner.samples_per_s > 0.02:
        return f": {seconds(runner.comm_s)} of {runner.name}'s communication per step against {seconds(best.comm_s)}"
    if runner.recompute and not best.recompute:
        return (f": {runner.name} recomputes activations on {device_kinds(runner.recompute)} (checkpointing, compute "
                f"×4/3) to fit; {best.name} fits without it")
    if runner.family in PIPELINES:
        return ": the pipeline's fill and drain (bubble) idles its stages"
    if best.family in PIPELINES:
        return ": each device holds only its stage, leaving room for larger micro-batches"
    return ""


def spec_of(row: LayoutRow) -> dict:
    """The layout object that runs a row of the ranking, as data (layout_spec.to_spec): the row says what runs."""
    from ..layout_spec import DataParallel, Pipeline, TensorParallel
    from .rows import FAMILIES

    sharding = {family: s for s, family in FAMILIES.items()}
    layout = (DataParallel(sharding=sharding[row.family]) if row.family in sharding
              else Pipeline() if row.family == "PP" else Pipeline(stages=row.stages) if row.family == "DP×PP"
              else TensorParallel() if row.family == "TP" else TensorParallel(split="speed"))
    return to_spec(layout)
