"""prepare() for the layouts that hold the whole model (or a shard of every layer) on every rank:
DataParallel (data.py's loop) and TensorParallel (tensor.py's). Each class owns its plan and
build steps; setup.prepare_job calls them in order without asking which layout it is.

    check  the job-dependent checks (runtime/layouts/choose.check)
    plan   measure every rank (or take the given Plan / auto's measurements), split, complete it
           (complete.py: precision, checkpointing, offload, the compression the wrapper will run)
           and adopt it: job.plan; returns rank 0's count of the model's FLOPs per sample (data
           parallel only)
    build  apply the plan: activation checkpointing per plan, wrap the model and optimizer, the
           optimizer offload, the layout's loop object, the sync guard, the rebalancer, what was
           built shown. It adopts nothing: a wrapper that is not what the plan says is a bug.
"""

from __future__ import annotations

from dataclasses import replace

from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import HetrainError, UsageError
from ...layout_spec import DataParallel, TensorParallel, to_spec
from ...planning.plan import Plan
from ..loop import flops
from ..measure.joint import check_given_plan, measure_job
from ..measure.measurements import plan_from_measurements
from ..measure.model_call import unmeasured_plan
from ..memory import activation_checkpointing as checkpointing
from ..memory import device_memory as memory
from ..memory import offload
from ..model import PreparedModel
from ..replan import adopt
from ..resilience import oom as recovery
from ..resilience import resume as persist
from ..resilience.rebalance import FirstSteps, Rebalancer
from ..ranks.islands import for_job as island_layout
from ..sharding import comm_hooks, island_hooks
from .checks import check_request
from .complete import BUG, across_islands, check_built, complete
from .data import DataLayout
from .tensor.loop import TensorLayout


class DataSetup:
    """DataParallel: DDP, or the sharding the object names (None: the planner's choice, made
    when the plan is completed, from this rank's activations as it runs them:
    device_memory.sharding_for)."""

    loop_class = DataLayout

    def __init__(self, spec, loss_fn):
        self.spec, self.loss_fn = spec, loss_fn
        self.strategy = None          # the sharding the plan in force was completed for
        self.activations = None       # this rank's, as measured for it (the build reuses them)
        self._decided_for = None      # the plan's figures the sharding was decided from

    def check(self, job) -> None:
        check_request(self.spec, world_size=job.world_size)

    @property
    def blocks_compression(self) -> str | None:
        """Why gradient compression cannot run here (None: it can): a sharding asked for (the
        planner's own choice of one is settled when the plan is completed: comm_hooks.settle)."""
        sharding = self.spec.sharding
        return None if sharding in (None, "none") else f"parallel={self.spec!r}"

    def describe(self, job) -> str:
        return f"{job.plan.describe_layout()}, parallel={self.spec!r}"

    def plan(self, job, model, optimizer, forward, given_plan: Plan | None, measured):
        plan = self.split(job, model, optimizer, forward, given_plan, measured, blocked_by=self.blocks_compression)
        if given_plan is None:        # planned here: its record of the layout object
            plan = replace(plan, layout_spec=to_spec(self.spec))
        adopt(job, self.complete(job, model, optimizer, forward, plan), "given" if given_plan is not None else "planned")
        # Before wrapping: a forward of the plain model runs no collective, so rank 0 counts alone.
        return flops.count_for(job, model, forward)

    def complete(self, job, model, optimizer, forward, plan: Plan) -> Plan:
        """`plan` with this job's records, the compression for the sharding the wrapper will run
        (a collective when the planner chooses it: DataParallel(sharding=None))."""
        def sharding(p):
            # decided again only for a plan that changes what it reads (alike on every rank: the plan is)
            key = tuple((d.device, d.micro_batch, d.n_micro, d.checkpointing, d.checkpoint_blocks, d.offload_optimizer)
                        for d in p.devices)
            if key != self._decided_for:
                self.strategy, self.activations = memory.sharding_for(job, model, optimizer, forward, p,
                                                                      requested=self.spec.sharding, known=self.activations)
                self._decided_for = key
            return self.strategy
        return complete(job, model, plan, sharding=sharding)

    def split(self, job, model, optimizer, forward, given_plan: Plan | None, measured, *, blocked_by,
              spec=None) -> Plan:
        """The model set up for measuring, job.profiles, and the plan to adopt: the given plan or
        the data-parallel split of the measurements (what TensorParallel shares)."""
        if measured is None:          # parallel='auto' measured already (and set the model up for it)
            measure_setup(job, model, optimizer)
        plan, job.profiles = plan_split(job, model, optimizer, forward, given_plan, spec or self.spec,  # (collective)
                                        measured=measured.measurements if measured is not None else None,
                                        blocked_by=blocked_by)
        return plan

    def build(self, job, model, optimizer, forward) -> None:
        # The plan in force (a checkpoint's, by now) decides activation checkpointing and sharding.
        apply_checkpointing(job, model)
        wrapped, job.memory_plan, oom_recovery = memory.wrap_for_plan(                              # (collective)
            job, model, optimizer, forward, strategy=self.spec.sharding or self.strategy, activations=self.activations)
        check_built(job.plan, predicted=self.strategy, built=wrapped.strategy)
        self.install(job, model, optimizer, wrapped, self.loop_class(self.loss_fn), oom_recovery=oom_recovery,
                     settle=True)
        job.rebalancer = make_rebalancer(job.config, job.world_size, unmeasured=job.unmeasured is not None)

    def install(self, job, model, optimizer, wrapped, loop, *, oom_recovery: bool, settle: bool) -> None:
        """The wrapped model, its optimizer, sync and guard into the job, and the layout's loop
        object (what TensorParallel shares). `settle`: check that the plan records the compression
        this wrapper runs (comm_hooks.settle, and none across islands), before the guard installs its hook."""
        if oom_recovery != job.config.memory.oom_recovery:   # TP: an OOM ends the attempt (runtime/layouts/tensor.py)
            job.reconfigure(memory=replace(job.config.memory, oom_recovery=oom_recovery))
        cfg = job.config
        job.layout = loop
        job.sync = wrapped.sync                       # DDP, FSDP2's adapter, or None (TP: nothing to sync)
        if settle and across_islands(job, comm_hooks.settle(
                job.plan, request=cfg.compression.method, strategy=wrapped.strategy, backend=job.ctx.backend,
                world_size=job.world_size)) != job.plan:
            raise HetrainError(f"the plan in force says gradient compression {job.plan.compression}, which the "
                               f"wrapper (sharding {wrapped.strategy!r}) does not run", BUG)
        job.guard = make_sync_guard(job, wrapped)
        job.model = PreparedModel(model, wrapped.forward_module, job.hooks.meter)
        job.optimizer = wrapped.optimizer             # FSDP2/ZeRO/TP may have made a new one
        job.optimizer = offload.apply(job, job.optimizer, wrapped.strategy)   # its state on the host where planned (collective)
        persist.check_registered(job, optimizer)      # state registered before prepare() on the replaced one: refused
        memory.show_wrapping(job.log, wrapped)
        job.hooks.attach(model)                       # CUDA: the last backward's compute, timed to its last gradient
        if job.faults:                                # injected faults strike inside the compute (devices/hooks.py)
            job.hooks.attach_faults(model, block_type=cfg.memory.blocks, sharded=wrapped.strategy == "fsdp")


class TensorSetup:
    """TensorParallel: every layer sharded over every rank, evenly or by speed (tensor.py). It
    holds a data-parallel part and delegates what the two share to it: measuring, the split it
    turns into its own plan (tensor_plan), and installing the wrapped model."""

    loop_class = TensorLayout

    def __init__(self, spec, loss_fn):
        self.spec, self.loss_fn = spec, loss_fn
        self.data = DataSetup(DataParallel(sharding="none"), loss_fn)

    def check(self, job) -> None:
        check_request(self.spec, world_size=job.world_size)

    @property
    def blocks_compression(self) -> str | None:
        return f"parallel={self.spec!r}"

    def describe(self, job) -> str:
        return f"{job.plan.describe_layout()}, parallel={self.spec!r}"

    def plan(self, job, model, optimizer, forward, given_plan: Plan | None, measured):
        plan = self.data.split(job, model, optimizer, forward, given_plan, measured, blocked_by=self.blocks_compression,
                               spec=self.spec)   # a given plan is checked against this layout, not the DP part's
        if given_plan is None:        # the data-parallel split as tensor parallelism runs it
            plan = tensor_plan(plan, job.profiles, split=self.spec.split, margin=job.config.memory.margin,
                               limit=job.config.memory.max_micro_batch)
        adopt(job, self.complete(job, model, optimizer, forward, plan), "given" if given_plan is not None else "planned")
        return None                   # MFU's FLOPs are counted on the whole model: plain DP only

    def complete(self, job, model, optimizer, forward, plan: Plan) -> Plan:
        """`plan` with this job's records (no DDP all-reduce: its compression stays none)."""
        return complete(job, model, plan)

    def build(self, job, model, optimizer, forward) -> None:
        from .tensor.loop import wrap

        apply_checkpointing(job, model)
        wrapped = wrap(job, model, optimizer, split=self.spec.split)                                # (collective)
        job.memory_plan = None
        # in-loop OOM recovery off: an OOM ends the attempt (tensor.py says why)
        self.data.install(job, model, optimizer, wrapped, self.loop_class(self.loss_fn), oom_recovery=False,
                          settle=False)
        job.rebalancer = None         # every rank computes the whole batch: no shares to move


def tensor_plan(plan: Plan, profiles, *, split: str, margin: float, limit: int | None) -> Plan:
    """The data-parallel plan as tensor parallelism runs it: one group of every rank, each
    computing the whole batch, in micro-batches every rank's memory holds beside its part of the
    model (they run in lockstep): planning/tensor_split.tp_micro_batch, the layout ranking's choice.
    Each device's speed becomes its rate a sample relative to the fastest (1 / per_sample_s), the
    weights a split by speed cuts the layers by, as the ranking and `hetrain plan`'s probe cut them:
    the data-parallel plan's speeds are its shares' rates, fixed costs a micro-batch included."""
    from .tensor.split import speed_fractions, tp_micro_batch

    w = plan.world_size
    speeds = [d.speed for d in plan.devices]
    if profiles is not None:   # a rank's rate a sample, as the ranking splits (not the DP shares' rate)
        speeds = [min(p.per_sample_s for p in profiles) / p.per_sample_s for p in profiles]
    fractions = speed_fractions([1 / v for v in speeds]) if split == "speed" else (1 / w,) * w
    if profiles is None:   # a given data-parallel plan: its caps hold the whole model, a shard holds less
        caps = tuple(d.max_micro_batch or plan.global_batch for d in plan.devices)
        micro = min(min(caps), plan.global_batch, limit or plan.global_batch)
    else:
        micro, caps = tp_micro_batch(profiles, fractions, global_batch=plan.global_batch, margin=margin,
                                     limit=limit)
    if micro < 1:
        i = min(range(w), key=lambda k: caps[k])
        raise UsageError(
            f"parallel='tp': {plan.devices[i].device} cannot hold its {fractions[i]:.0%} of the model state and "
            "one sample's activations", "free memory on it, or split the model over more devices "
            "(parallel='pp' puts fewer layers on the small one)")
    why = f"in micro-batches of {micro} (every rank's memory holds one beside its part of the model)" \
        if micro < plan.global_batch else "in one micro-batch (every rank's memory holds it)"
    devices = tuple(replace(d, share=plan.global_batch, micro_batch=micro, max_micro_batch=micro, speed=v,
                            reasons=(f"tensor parallel: every rank computes all {plan.global_batch} samples, {why}",))
                    for d, v in zip(plan.devices, speeds))
    return replace(plan, devices=devices, layout="tp", layout_spec=to_spec(TensorParallel(split=split)),
                   group=plan.world_size, compression="none")


def measure_setup(job, model, optimizer) -> None:
    """The whole model on this rank's device, counted, checkpointed as configured: what the
    data-parallel probe measures (a pipeline moves only its stage: runtime/layouts/pipeline/setup.py)."""
    model.to(job.device)
    if job.hooks.meter is not None:                   # a device that counts its bytes holds the model from here
        job.hooks.meter.set_fixed(model, optimizer)
    if job.config.memory.activation_checkpointing == "all":             # before the probe: measure what will run
        checkpointing.checkpoint_blocks(model, job.config.memory.blocks)


def plan_split(job, model, optimizer, forward, given: Plan | None, spec, *, measured=None,
               blocked_by: str | None = None) -> tuple[Plan, tuple | None]:
    """The given plan (checked against this job and its layout object `spec`), or every rank's
    measured profiles through the same pure planner (runtime/measure/joint.py). Returns the plan
    and the profiles it was made from. `blocked_by`: what keeps gradient compression off."""
    if given is not None:
        return check_given_plan(job, given, layout=spec), None
    if measured is None and job.unmeasured is not None:    # hetrain could not call the model
        job.log.info(f"{job.unmeasured}: planned from the catalog, then from the device times of the first steps")
        return unmeasured_plan(job), None
    if measured is None:
        measured = measure_job(job, model, optimizer, forward)
    return plan_from_measurements(measured, job.config, blocked_by=blocked_by)


def apply_checkpointing(job, model) -> None:
    """Activation checkpointing on this rank's blocks where the plan in force says (complete.py
    recorded every rank's: a plan that does not is hetrain's bug)."""
    plan, _ = checkpointing.apply_from_plan(model, job.plan, job.rank, mode=job.config.memory.activation_checkpointing,
                                            block_type=job.config.memory.blocks)
    if plan != job.plan:
        raise HetrainError(f"the plan in force (v{job.plan.version}) does not record the activation checkpointing "
                           f"Memory(activation_checkpointing={job.config.memory.activation_checkpointing!r}) runs", BUG)


def make_sync_guard(job, wrapped):
    """The gradient sync's comm hook on DDP (runtime/sharding/comm_hooks.py: compressed as the plan
    says, through the job's inter-node link where it is modelled) and OOM recovery's guard: recovery.SyncGuard, which
    calls that hook and records the buckets a backward launched (FSDP2's adapter guards itself).
    Without OOM recovery the hook alone, or DDP's own C++ all-reduce when the hook would add nothing."""
    cfg = job.config
    guard = cfg.memory.oom_recovery and job.world_size > 1
    if cfg.memory.oom_recovery:
        recovery.keep_anchor(job.device)     # drains a failed backward's graph (oom.release_graph)
    if not isinstance(wrapped.sync, DDP):
        made = wrapped.sync_guard() if guard else None
    elif (islands := island_layout(job)) is not None:   # ranks on 2+ device islands: the hierarchical all-reduce
        made = recovery.install(wrapped.sync, island_hooks.make(job, islands), guard=guard)
    else:
        gradient = comm_hooks.GradientHook(job.plan.compression, powersgd_rank=cfg.compression.powersgd_rank,
                                           link=job.hooks.measuring().link(job), backend=job.ctx.backend,
                                           device_waits=job.hooks.syncs_at_collectives)
        made = recovery.install(wrapped.sync, gradient, guard=guard)
    if made is not None and job.hooks.meter is not None:   # what the completion allocates, on the device's meter
        made.allocating = job.hooks.meter.allocating
    return made


def make_rebalancer(cfg, world_size: int, *, unmeasured: bool = False) -> Rebalancer | None:
    """The online rebalancer; over a plan that was not measured (measure/model_call.py), one that
    re-plans from the first steps' device times at once."""
    if not (cfg.rebalancing.enabled and world_size > 1):
        return None
    return (FirstSteps if unmeasured else Rebalancer)(world_size=world_size, threshold=cfg.rebalancing.threshold, micro_batch_cap=cfg.memory.max_micro_batch)
