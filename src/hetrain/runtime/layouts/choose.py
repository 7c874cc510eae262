"""Which layout a job runs: prepare(parallel=...) — a layout object (hetrain.DataParallel,
TensorParallel, Pipeline: layout_spec.py), one of the shorthands 'auto', 'dp', 'pp', 'dp-pp',
'tp', or a Plan. `resolve` turns a shorthand or a Plan into the object, in this one place:

    'dp' -> DataParallel()        'tp' -> TensorParallel()        'pp' -> Pipeline()
    'dp-pp' -> Pipeline(stages='auto')      a Plan -> its layout's object (the Plan then fixes it)

'auto' (`decide`) ranks every layout on what this job measures, with the function and ranking
`hetrain plan --model-factory` uses (ranking.measure_for_ranking, then
measurements.rank_job_measurements), and runs the ranking's best (`layout_for`): the same answer
as `hetrain plan`'s recommendation on the same measurements. One device: DataParallel() (there is
nothing to rank). Without loss_fn a pipeline cannot run: the best of the other rows, by the same
rule (measurements.recommended).
Every rank decides from the same exchanged values, so all take the same branch.
"""

from __future__ import annotations

from ...errors import UsageError, did_you_mean
from ...layout_spec import LAYOUT_TYPES, DataParallel, Pipeline, TensorParallel, from_spec, reconcile
from ...planning.plan import Plan
from ...vocabulary import PARALLEL_REQUESTS


_ALIASES = {"pipeline": "pp", "pipe": "pp", "tensor": "tp", "data": "dp", "ddp": "dp",
            "fsdp": "dp (with sharding='fsdp')", "zero": "dp (with sharding='zero1')", "hybrid": "dp-pp", "dp×pp": "dp-pp", "dpxpp": "dp-pp", "dp+pp": "dp-pp", "dppp": "dp-pp"}


_SHORTHANDS = {"dp": DataParallel(), "tp": TensorParallel(), "pp": Pipeline(), "dp-pp": Pipeline(stages="auto")}
LAYOUT_OBJECTS = "hetrain.DataParallel(...), hetrain.TensorParallel(...), hetrain.Pipeline(...)"


def requested(parallel) -> str:
    """The shorthand asked for, one of PARALLEL_REQUESTS (a one-line error otherwise)."""
    if not isinstance(parallel, str) or parallel not in PARALLEL_REQUESTS:
        alias = _ALIASES.get(parallel.lower().replace(" ", "")) if isinstance(parallel, str) else None
        hint = (f" (did you mean: {alias}?)" if alias else did_you_mean(parallel, PARALLEL_REQUESTS)) \
            if isinstance(parallel, str) else ""
        raise UsageError(f"prepare(parallel={parallel!r}) is not a layout{hint}",
                         f"use {LAYOUT_OBJECTS}, one of {', '.join(PARALLEL_REQUESTS)}, or a Plan from "
                         "`hetrain plan --out`")
    return parallel


def resolve(parallel, given_plan: Plan | None, *, world_size: int):
    """(the layout object or 'auto', the Plan that fixes it or None): every shorthand resolved
    here. A Plan passed as `parallel` is the plan (it overrides init(plan=) for this prepare) and
    runs its own layout, as 'auto' with a given plan does; an object or shorthand with a plan for
    another layout is refused with both named (layout_spec.reconcile), one that agrees takes the
    plan's values for the fields it left open (DataParallel's sharding, a pipeline's stage count)."""
    if isinstance(parallel, Plan):
        parallel, given_plan = "auto", parallel
    asked_as = f"prepare(parallel={parallel!r})"
    if not isinstance(parallel, LAYOUT_TYPES):
        if requested(parallel) == "auto":
            if given_plan is None:
                return "auto", None
            return from_spec(given_plan.layout_record()), given_plan
        parallel = _SHORTHANDS[parallel]
    if given_plan is not None:
        parallel = reconcile(given_plan.layout_record(), parallel, world_size=world_size, asked_as=asked_as)
    return parallel, given_plan


def layout_for(row):
    """The layout object that runs a ranking row (planning/ranking.LayoutRow): pure. The DP family
    by its sharding, 'PP' one pipeline, 'DP×PP d×k' replicas of k stages, 'TP', 'TP by speed'."""
    from ...planning.ranking import FAMILIES

    sharding = {family: s for s, family in FAMILIES.items()}
    if row.family in sharding:
        return DataParallel(sharding=sharding[row.family])
    if row.family == "PP":
        return Pipeline()
    if row.family == "DP×PP":
        return Pipeline(stages=row.stages)
    if row.family == "TP":
        return TensorParallel()
    if row.family == "TP by speed":
        return TensorParallel(split="speed")
    raise ValueError(f"no layout object for the ranking's row {row.name!r} ({row.family})")


def decide(job, spec, model, optimizer, forward, loss_fn):
    """(the layout object, what auto measured or None) for `spec` (resolve's). Collective for 'auto'."""
    if spec != "auto":
        return spec, None
    if job.world_size == 1:
        job.log.detail("parallel=auto chose DataParallel(): one device")
        return DataParallel(), None
    from ..measure.measurements import RECOMMENDED_FAMILIES, rank_job_measurements, recommended
    from .data_setup import measure_setup
    from .ranking import measure_for_ranking

    measure_setup(job, model, optimizer)
    found = measure_for_ranking(job, model, optimizer, forward)                                    # (collective)
    ranking = rank_job_measurements(found.measurements, job.config, facts=found.facts, blocks=found.blocks)[0]
    if loss_fn is None:          # a pipeline cannot run without it: the best of the rest, by the same rule
        ranking = recommended(ranking, families=[f for f in RECOMMENDED_FAMILIES if f not in ("PP", "DP×PP")])
    if ranking.best is None:
        # Nothing the ranking may pick fits, often for a reason of the job's own (a global batch
        # smaller than the devices): plain data parallelism's own plan names it, with its fix.
        job.log.info(f"parallel=auto: no layout it may run fits ({ranking.why}); DataParallel()'s own plan says why")
        return DataParallel(), found
    best, why = ranking.best, ranking.why
    chosen = layout_for(best)
    job.log.detail(f"parallel=auto chose {chosen!r}: {why}")
    return chosen, found


def refuse_removed_keywords(removed: dict) -> None:
    """prepare(schedule=, stages=, micro_batches=): one UsageError naming parallel=Pipeline(...);
    any other unknown keyword: Python's own TypeError."""
    if not removed:
        return
    moved = [n for n in removed if n in ("schedule", "stages", "micro_batches")]
    if len(moved) < len(removed):
        raise TypeError(f"prepare() got an unexpected keyword argument "
                        f"{next(n for n in removed if n not in moved)!r}")
    given = ", ".join(f"{n}={removed[n]!r}" for n in moved)
    raise UsageError(f"prepare({given}): a pipeline's stages, micro-batches and schedule are no longer keywords "
                     "of prepare(), they are the layout's",
                     "pass parallel=hetrain.Pipeline(stages=..., micro_batches=..., schedule=...)")
