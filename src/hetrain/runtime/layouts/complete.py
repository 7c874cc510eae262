"""A plan made complete for this job: every record prepare() and a re-plan add to a layout's split,
decided before anything is built, so that the build only applies the plan and nothing rewrites it.

    precision      every rank's agreed precision (the job's precision policy)
    checkpointing  each rank's activation checkpointing as it will run (Memory(activation_checkpointing=):
                   'all' records every block of every rank; the model must have blocks where any rank needs them)
    offload        each rank's optimizer offload as it will run (Memory(offload_optimizer=))
    compression    the gradient compression the data-parallel wrapper will run (comm_hooks.settle, for
                   the sharding it will wrap with), and none where ranks on several device islands sum
                   hierarchically (that all-reduce sends the gradients whole)

Every one is a record: the plan keeps its version. A layout's plan() ends with `complete`, and a
resumed checkpoint's plan goes through it too (runtime/replan.replan, before the build), so it gets
this job's records rather than the run's that saved it; a re-plan during training keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ...errors import HetrainError
from ...planning.plan import Plan
from ..memory import activation_checkpointing as checkpointing
from ..memory import offload
from ..sharding import comm_hooks

# What a built wrapper is compared with: a difference is hetrain's bug, not the user's.
BUG = "this is a bug in hetrain (the plan in force must say what runs); please report it with the log"


def complete(job, model, plan: Plan, *, checkpoints: bool = True,
             sharding: Callable[[Plan], str] | None = None) -> Plan:
    """`plan` with every record of this job (the module docstring lists them). `model`: the unwrapped
    model, whose blocks the checkpointing record checks (None after prepare: checked then).
    `checkpoints`: whether the layout applies activation checkpointing from the plan (a pipeline's
    stages keep their own). `sharding`: the sharding the data-parallel wrapper will run for the
    plan with its other records, which decides the compression (None: no gradient all-reduce of
    DDP's here, the plan's compression stays as the layout made it)."""
    cfg = job.config
    plan = job.precision.record_in(plan)
    if checkpoints:
        plan = checkpointing.decide(model, plan, mode=cfg.memory.activation_checkpointing,
                                    block_type=cfg.memory.blocks)
    plan, _ = offload.decide(plan, cfg.memory.offload_optimizer)
    if sharding is not None:
        plan = comm_hooks.settle(plan, request=cfg.compression.method, strategy=sharding(plan),
                                 backend=job.ctx.backend, world_size=job.world_size)
        plan = across_islands(job, plan)
    return plan


def across_islands(job, plan: Plan) -> Plan:
    """Ranks on 2+ device islands sum their gradients hierarchically (sharding/island_hooks.py),
    which sends them whole: the plan's compression none, with the reason in its note."""
    from ..ranks.islands import for_job as island_layout

    if plan.compression == "none" or island_layout(job) is None:
        return plan
    return replace(plan, compression="none", note=comm_hooks.with_note(
        plan.note, f"gradient compression none: {plan.compression} is not run by the hierarchical "
                   "all-reduce across islands"))


def check_built(plan: Plan, *, predicted: str, built: str) -> None:
    """The wrapper runs the sharding the plan was completed for (HetrainError otherwise: the plan's
    compression and memory records would not be what runs)."""
    if built != predicted:
        raise HetrainError(f"the model was wrapped under sharding {built!r}, but the plan in force (v{plan.version}) "
                           f"was completed for sharding {predicted!r}", BUG)
