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
from ...layout_spec import LAYOUT_TYPES, DataParallel, Pipeline, TensorParallel
from ...planning.memory import state_bytes
from ...planning.plan import Plan
from ...vocabulary import PARALLEL_REQUESTS


_ALIASES = {"pipeline": "pp", "pipe": "pp", "tensor": "tp", "data": "dp", "ddp": "dp",
            "fsdp": "dp (with sharding='fsdp')", "zero": "dp (with sharding='zero1')", "hybrid": "dp-pp", "dp×pp": "dp-pp", "dpxpp": "dp-pp", "dp+pp": "dp-pp", "dppp": "dp-pp"}


_SHORTHANDS = {"dp": DataParallel(), "tp": TensorParallel(), "pp": Pipeline(), "dp-pp": Pipeline(stages="auto")}
LAYOUT_OBJECTS = "hetrain.DataParallel(...), hetrain.TensorParallel(...), hetrain.Pipeline(...)"


def requested(parallel, given_plan: Plan | None) -> str:
    """The layout asked for: a Plan's, or one of PARALLEL_REQUESTS (a one-line error otherwise)."""
    if isinstance(parallel, Plan):
        return parallel.layout
    if not isinstance(parallel, str) or parallel not in PARALLEL_REQUESTS:
        alias = _ALIASES.get(parallel.lower().replace(" ", "")) if isinstance(parallel, str) else None
        hint = (f" (did you mean: {alias}?)" if alias else did_you_mean(parallel, PARALLEL_REQUESTS)) \
            if isinstance(parallel, str) else ""
        raise UsageError(f"prepare(parallel={parallel!r}) is not a layout{hint}",
                         f"use {LAYOUT_OBJECTS}, one of {', '.join(PARALLEL_REQUESTS)}, or a Plan from "
                         "`hetrain plan --out`")
    if parallel == "auto" and given_plan is not None:
        return given_plan.layout
    return parallel


def resolve(parallel, given_plan: Plan | None):
    """(the layout object or 'auto', the Plan that fixes it or None): every shorthand resolved here."""
    if isinstance(parallel, LAYOUT_TYPES):
        return parallel, given_plan
    if isinstance(parallel, Plan):
        given_plan = parallel
    kind = requested(parallel, given_plan)
    return ("auto" if kind == "auto" else _SHORTHANDS[kind]), given_plan


def check_request(kind: str, *, world_size: int) -> None:
    """What 'dp' and 'tp' need of the job (a Pipeline's needs: check_pipeline)."""
    if kind == "tp" and world_size < 2:
        raise UsageError(f"parallel={kind!r} on one device: there is nothing to split the model over",
                         "launch on 2+ devices (hetrain run --emulate ... or one process per GPU), or use parallel='dp'")


def state_factor(modules, optimizer_kind: str) -> float:
    """Model-state bytes per parameter byte of these modules' parameters (memory.state_bytes,
    frozen parameters as weights only)."""
    params = [p for m in modules if m is not None for p in m.parameters()]
    n = sum(p.numel() for p in params)
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    pbytes = train[0].element_size() if train else (params[0].element_size() if params else 4)
    fine = dict(trainable=sum(p.numel() for p in train),
                frozen_param_bytes=frozen[0].element_size() if frozen else None)
    weights = sum(p.numel() * p.element_size() for p in params)
    if not weights:
        return 1.0
    return state_bytes(n, optimizer=optimizer_kind, param_bytes=pbytes, **fine).total / weights


def check_pipeline(spec: Pipeline, *, loss_fn, world_size: int) -> None:
    """What a Pipeline needs of the job, checked when prepare() sees it (one line: reason, fix)."""
    shown = f"parallel={spec!r}"
    if loss_fn is None:
        raise UsageError(f"{shown} needs the loss function: the pipeline's schedule computes the loss on the last "
                         "stage", "pass loss_fn=(output, targets) -> mean loss to ht.prepare()")
    if world_size < 2:
        raise UsageError(f"{shown} on one device: there is nothing to split the model over",
                         "launch on 2+ devices (hetrain run --emulate ... or one process per GPU), or use "
                         "parallel=hetrain.DataParallel()")
    stages = spec.stages
    if stages == "auto" and (world_size < 4 or world_size % 2):
        raise UsageError(f"{shown} needs replicas of 2+ stages: {world_size} devices do not make 2+ of them",
                         "use 4, 6, 8... devices, or parallel=hetrain.Pipeline() (one pipeline)")
    divisors = ", ".join(str(k) for k in range(2, world_size + 1) if world_size % k == 0)
    if isinstance(stages, int) and stages > world_size:
        raise UsageError(f"{shown}: {stages} stages need {stages} devices, this job has {world_size}",
                         f"use a stage count that divides {world_size}: {divisors}")
    if isinstance(stages, int) and world_size % stages:
        raise UsageError(f"{shown}: {world_size} devices do not form pipelines of {stages} stages",
                         f"use a stage count that divides {world_size}: {divisors}")


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
