"""The pipeline layouts behind the Layout protocol (protocol.py): PipelineSetup, one pipeline
over every device, and HybridSetup, DP×PP's replicas of k stages. Their steps are
pipeline_setup.py's functions (measure the blocks, plan the split, build this rank's stage)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ....errors import UsageError
from ....planning.plan import Plan
from ...measure.joint import check_given_plan
from ...model import PreparedModel
from ...replan import adopt
from ..complete import complete
from . import stage_hooks
from .sizing import NOT_MEASURED, show
from ...resilience import resume as persist
from ..checks import check_pipeline
from .setup import (NO_RESPLIT_HYBRID, build_stage, make_resplitter, measure_blocks, on_clock,
                             plan_pipeline)
from .loop import PipelineLayout

if TYPE_CHECKING:
    from .schedule import Pipeline


class StagedModel(PreparedModel):
    """What prepare() returns under a pipeline: the user's model for state_dict and attributes;
    parameters() are this stage's. It cannot be called: no rank holds the whole model."""

    def forward(self, *args, **kwargs):
        raise UsageError("under a pipeline layout the model is split over the ranks: calling it on one rank "
                         "cannot compute the output", "compute the loss with ht.backward(ht.loss(mb)) (loss_fn= in prepare)")


def show_split(job, pipe: Pipeline) -> None:
    """The split as a table on rank 0 (every replica's stages gathered by the plan)."""
    plan = job.plan
    profile = pipe.profile
    title = (f"{plan.layout}: {plan.describe_layout()}, {plan.devices[0].n_micro} micro-batches "
             f"of {plan.devices[0].micro_batch}")
    # the plan's reasons follow in its own table (this split was rebuilt from its blocks per stage)
    show(job, title, [pipe.split], (), measured=profile is not None and profile.source != NOT_MEASURED)
    said = stage_hooks.of_job(job).predicted_said(plan.predicted, stages=len(plan.devices),
                                                  global_batch=plan.global_batch)
    if said:                     # what the stages' shared host adds to the prediction, where it does
        job.log.info(said)



class PipelineSetup:
    """Pipeline(): one pipeline over every device, this rank one stage of it. Its blocks move
    between stages online when a stage's speed changes (the resplitter). The same steps as
    data_setup.DataSetup, in the same order."""

    loop_class = PipelineLayout
    one_pipeline = True

    def __init__(self, spec, loss_fn):
        self.spec, self.loss_fn = spec, loss_fn
        self.parts = self.profile = self.devices = None

    def check(self, job) -> None:
        check_pipeline(self.spec, loss_fn=self.loss_fn, world_size=job.world_size)

    @property
    def blocks_compression(self) -> str | None:
        return f"parallel={self.spec!r}"

    def describe(self, job) -> str:
        return f"{job.plan.describe_layout()}, parallel={self.spec!r}"

    def plan(self, job, model, optimizer, forward, given_plan: Plan | None, measured):
        from ...memory.device_memory import optimizer_kind
        from .blocks import find_parts

        if measured is not None and measured.pipeline_parts is not None:    # parallel='auto' measured them
            parts, profile, devices = measured.pipeline_parts
        else:
            parts = find_parts(model)
            profile, devices = measure_blocks(job, parts)                                            # (collective)
        profile = on_clock(job, profile)
        if given_plan is not None:    # run as given: a plan for another layout is refused, never re-planned
            plan = check_given_plan(job, given_plan, layout=self.spec)
        else:
            stages = None if self.spec.stages in (None, "auto") else self.spec.stages
            plan = plan_pipeline(job, self.one_pipeline, parts, profile, devices,
                                 optimizer_kind=optimizer_kind(optimizer) or "adamw",
                                 schedule=self.spec.schedule, stages=stages, micro_batches=self.spec.micro_batches)
        adopt(job, self.complete(job, model, optimizer, forward, plan), "given" if given_plan is not None else "planned")
        self.parts, self.profile, self.devices = parts, profile, devices
        return None

    def complete(self, job, model, optimizer, forward, plan: Plan) -> Plan:
        """`plan` with this job's records (layouts/complete.py): the stages keep the plan's own
        checkpointing, and sum their gradients without DDP's hook (no compression)."""
        return complete(job, model, plan, checkpoints=False)

    def build(self, job, model, optimizer, forward) -> None:
        from ...memory import offload
        from ...memory.device_memory import optimizer_kind

        job.layout, job.optimizer = build_stage(job, model, optimizer, job.plan, self.parts, self.profile,
                                                self.devices, self.loss_fn)                          # (collective)
        job.optimizer = offload.apply(job, job.optimizer, "pipeline")   # a plan's offload: refused here (dp only)
        pipe = job.layout.pipe
        job.model = StagedModel(model, pipe.module, None)
        job.sync = job.guard = None                   # the pipeline syncs its own gradients; shares stay
        job.rebalancer = self.rebalancer(job, optimizer_kind(optimizer) or "adamw")
        persist.check_registered(job, optimizer)
        if job.hooks.meter is not None:
            job.hooks.meter.set_fixed(pipe.module, job.optimizer)         # this stage's state, not the model's
        show_split(job, pipe)

    def rebalancer(self, job, optimizer_kind: str):
        """The blocks move online (pipeline_setup.make_resplitter)."""
        return make_resplitter(job, self.devices, optimizer_kind)


class HybridSetup(PipelineSetup):
    """Pipeline(stages=k) for k below the device count (or 'auto': k planned): DP×PP, replicas of
    k stages whose stage gradients are averaged over the replicas. Its split stays as planned
    (every replica's stage must keep the same blocks) and its shares move only by re-planning."""

    one_pipeline = False

    def rebalancer(self, job, optimizer_kind: str):
        if job.config.rebalancing.enabled:
            job.log.info(NO_RESPLIT_HYBRID)
        return None
