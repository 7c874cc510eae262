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
from ...planning.memory import state_bytes
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


def check_request(spec, *, world_size: int) -> None:
    """What DataParallel and TensorParallel need of the job (a Pipeline's needs: check_pipeline)."""
    if isinstance(spec, TensorParallel) and world_size < 2:
        raise UsageError(f"parallel={spec!r} on one device: there is nothing to split the model over",
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
