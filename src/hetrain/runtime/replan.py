"""The one writer of the Plan in force (job.plan).

prepare() adopts the layout's plan once, complete (its plan() ends with layouts/complete.py's
`complete`: precision, checkpointing, offload, compression): the build applies it and adopts
nothing. A re-plan (a resumed checkpoint's plan, a rebalanced one, one with shrunk micro-batches
after an OOM) goes through `replan`: a resumed plan is completed the same way on this job before
the build; one made during training keeps what was built (checked), and is adopted. `adopt` checks that the plan is for this job and seals it: a Plan is frozen, and one
changed in place afterwards (a user's object.__setattr__ on ht.plan) is refused at the next step
(`check_unchanged`), as running a plan the ranks did not agree on would be.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import HetrainError, UsageError
from ..planning.plan import FROZEN, Plan

FROZEN_FIX = FROZEN + " and pass it to hetrain.init(plan=...) or prepare(parallel=plan)"


def adopt(job, plan: Plan, why: str) -> Plan:
    """Make `plan` the one in force; `why`: what made it ('planned', 'resumed', 'rebalanced', ...)."""
    if not isinstance(plan, Plan):
        raise HetrainError(f"{why}: {type(plan).__name__} is not a Plan", "this is a bug in hetrain; please report it")
    check_fits(job, plan, source="the given" if why == "given" else f"the {why}")
    job.run.plan = plan
    job.run.plan_seal = seal(plan)
    return plan


def replan(job, plan: Plan, why: str, *, complete: Callable[[Plan], Plan] | None = None) -> Plan:
    """A new plan in force after the layout's: `why` 'resumed', 'rebalanced', 'OOM'. `complete`:
    the layout's completion of it on this job (prepare() passes it for a resumed plan, before the
    build: its records are re-derived here, not carried over from the run that saved it). Without
    it (during training: what was built for the records stays built) the new plan must keep the
    records of the plan in force (`check_records`)."""
    if complete is not None:
        plan = complete(plan)
    else:
        check_records(job.plan, plan, why)
    return adopt(job, plan, why)


RECORDS = ("precision", "checkpointing", "checkpoint_blocks", "offload_optimizer")


def check_records(before: Plan, after: Plan, why: str) -> None:
    """A re-plan during training changes shares and micro-batches, never what was built for the
    plan in force: each rank's precision, activation checkpointing and optimizer offload, and the
    gradient compression (HetrainError naming the first change: a bug in what made the plan)."""
    changed = [f"rank {a.rank} {name} {getattr(b, name)!r} -> {getattr(a, name)!r}"
               for b, a in zip(before.devices, after.devices) for name in RECORDS if getattr(b, name) != getattr(a, name)]
    if before.compression != after.compression:
        changed.append(f"compression {before.compression!r} -> {after.compression!r}")
    if changed:
        raise HetrainError(f"the {why} plan v{after.version} changes what was built for the plan in force: "
                           + "; ".join(changed), "this is a bug in hetrain; please report it with the log")


def check_fits(job, plan: Plan, *, source: str = "the given") -> None:
    """The plan is for this job: its world size and global batch (the one consistency check)."""
    if plan.world_size != job.world_size or plan.global_batch != job.config.global_batch:
        raise UsageError(
            f"{source} plan is for {plan.world_size} device(s) and global batch {plan.global_batch}, "
            f"this job has {job.world_size} and {job.config.global_batch}",
            "make a plan for this job (`hetrain plan`), or drop the plan to let hetrain split",
        )


def check_unchanged(job) -> None:
    """At a step's start: the plan in force is the one adopted (UsageError when changed in place)."""
    plan = job.plan
    if plan is not None and seal(plan) != job.plan_seal:
        raise UsageError(f"the plan in force (ht.plan, v{plan.version}) was changed in place after it was "
                         f"adopted, before step {job.steps_done}", FROZEN_FIX)


def seal(plan: Plan) -> tuple:
    """The plan's fields, down to each device's, as values (microseconds: checked every step)."""
    return tuple((k, tuple(tuple(vars(d).items()) for d in v) if k in ("devices", "excluded") else
                  tuple(v.items()) if isinstance(v, dict) else v) for k, v in vars(plan).items())
