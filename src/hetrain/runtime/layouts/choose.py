"""Which layout a job runs: prepare(parallel=...) — a layout object (hetrain.DataParallel,
TensorParallel, Pipeline: layout_spec.py), one of the shorthands 'auto', 'dp', 'pp', 'dp-pp',
'tp', or a Plan. `resolve` turns a shorthand or a Plan into the object, in this one place:

    'dp' -> DataParallel()        'tp' -> TensorParallel()        'pp' -> Pipeline()
    'dp-pp' -> Pipeline(stages='auto')      a Plan -> its layout's object (the Plan then fixes it)

An explicit layout object runs as asked, whatever a ranking would prefer. 'auto' (`decide`) ranks
every layout on what this job measures, with the function and ranking `hetrain plan
--model-factory` uses (ranking.measure_for_ranking, then measurements.rank_job_measurements), and
runs the row the one chooser picks (planning/chooser.py: the fastest that fits whose resilience
the job's config keeps, or a simpler one within 5%): the same answer as `hetrain plan`'s on the
same measurements. The row says what runs (LayoutRow.spec, `layout_for`). One device:
DataParallel() (there is nothing to rank). Without loss_fn the pipelines are left out, said in one line.
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
    """The layout object that runs a ranking row (planning/ranking.LayoutRow): the one its spec records."""
    from ...layout_spec import from_spec

    if not row.spec:
        raise ValueError(f"the ranking's row {row.name!r} records no layout")
    return from_spec(row.spec)


def decide(job, spec, model, optimizer, forward, loss_fn):
    """(the layout object, what auto measured or None) for `spec` (resolve's). Collective for 'auto'.
    An explicit layout object is returned as it is: the ranking never overrides it."""
    if spec != "auto":
        return spec, None
    if job.world_size == 1:
        job.log.detail("parallel=auto chose DataParallel(): one device")
        return DataParallel(), None
    from .data_setup import measure_setup
    from .ranking import measure_for_ranking

    measure_setup(job, model, optimizer)
    # TP by speed is timed, as `hetrain plan` times it, wherever auto may run it: with OOM recovery
    # on the chooser leaves TP out, so the answer cannot depend on the probe and it is skipped.
    found = measure_for_ranking(job, model, optimizer, forward,                                     # (collective)
                                time_tp=not job.config.memory.oom_recovery)
    chosen, ranking = auto_layout(found.measurements, job.config, facts=found.facts, blocks=found.blocks,
                                  has_loss_fn=loss_fn is not None)
    for line in ranking.left_out:       # e.g. the pipelines, without loss_fn: one line each reason
        job.log.info(f"parallel=auto: {line}")
    if ranking.not_offered:             # TP on a model the runtime cannot split
        job.log.detail(f"parallel=auto: {ranking.not_offered}")
    if ranking.best is None:
        # Nothing the ranking may pick fits, often for a reason of the job's own (a global batch
        # smaller than the devices): plain data parallelism's own plan names it, with its fix.
        job.log.info(f"parallel=auto: no layout it may run fits ({ranking.why}); DataParallel()'s own plan says why")
    else:
        job.log.detail(f"parallel=auto chose {chosen!r}: {ranking.why}")
    return chosen, found


def auto_layout(measurements, config, *, facts: dict, blocks: int | None, has_loss_fn: bool):
    """(the layout object auto runs, the ranking it chose from) on these measurements: pure, the
    ranking `hetrain plan` prints (measurements.rank_job_measurements) and its chosen row's
    layout; DataParallel() when nothing it may run fits (its own plan then says why)."""
    from ..measure.measurements import rank_job_measurements

    ranking = rank_job_measurements(measurements, config, facts=facts, blocks=blocks, has_loss_fn=has_loss_fn)[0]
    return (layout_for(ranking.best) if ranking.best is not None else DataParallel()), ranking
