"""prepare(), in order: small functions over the job record (job.py), each taking what it needs
and returning what it makes. `prepare_job` is the whole order in one place; the comment on each
line says why it comes where it does. Lines marked (collective) are entered by every rank.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import default_collate

from ..errors import UsageError
from ..planning.compression import check_request as check_compression_request
from .parallel.blocks import find_parts
from ..planning.plan import Plan
from .layouts import choose
from .layouts import pipeline_setup as stages
from .layouts.data import DataLayout
from .layouts.tensor import TensorLayout
from .memory import activation_checkpointing as checkpointing
from .memory import device_memory as memory
from .resilience import resume as persist
from .resilience.store import Checkpointer
from .config import Config
from .loop import flops, metrics
from .loop.sampler import GlobalCursorSampler
from .job import Job
from .measure.joint import check_given_plan, measure_job, show_plan
from .measure.measurements import plan_from_measurements
from .model import PreparedModel
from .resilience import oom as recovery
from .resilience.rebalance import Rebalancer
from .devices.link import check_link_request, throttle_for
from .sharding import comm_hooks


def prepare_job(job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                collate_fn: Callable | None, forward: Callable, given_plan: Plan | None, parallel="auto",
                loss_fn: Callable | None = None, pipeline: dict | None = None) -> None:
    kind = choose.requested(parallel, given_plan)
    if isinstance(parallel, Plan):
        given_plan = parallel
    open_data(job, dataset, collate_fn)
    job.precision.agree(rank=job.rank, world_size=job.world_size, device=job.device, log=job.log)  # (collective)
    measured = None
    if kind == "auto":
        kind, measured = decide_auto(job, model, optimizer, loss_fn)                                # (collective)
    choose.check_request(kind, loss_fn=loss_fn, world_size=job.world_size)
    check_link_request(job)                           # emulate_link_gbs on real GPUs: refused here
    check_compression_request(job.config.compression.method, backend=job.ctx.backend,
                              blocked_by=f"parallel={kind!r}" if kind != "dp" else None)
    counted = None
    if kind in ("pp", "dp-pp"):
        prepare_pipelined(job, model, optimizer, kind, loss_fn, given_plan, measured,
                          pipeline or {"schedule": "1f1b", "stages": None, "micro_batches": None})
    else:
        counted = prepare_data_parallel(job, model, optimizer, forward, given_plan, kind, loss_fn)
    job.flops = flops.agree_flop_facts(job, counted)  # MFU's parts, on every rank            (collective)
    show_plan(job.log, job.plan, job.total_steps)
    job.log.info(f"layout: {job.plan.describe_layout()}")
    job.recorder = metrics.open_recorder(job)         # rank 0: metrics.jsonl (a restart appends), status lines
    job.log.flush()                                   # every rank's setup warnings, once     (collective)
    job.met_at = time.perf_counter()                  # the first step's period starts here, on every rank
    freeze_heap()


def prepare_data_parallel(job: Job, model, optimizer, forward, given_plan: Plan | None, kind: str, loss_fn):
    """'dp' and 'tp': the whole model (or a shard of every layer) on every rank. Returns rank 0's
    count of the model's FLOPs per sample (loop/flops.py; data parallel only), or None."""
    measure_setup(job, model, optimizer)
    job.plan, job.profiles = plan_split(job, model, optimizer, forward, given_plan, kind)           # (collective)
    if kind == "tp" and job.plan.layout != "tp":
        job.plan = tensor_plan(job.plan)
    # Before wrapping: a forward of the plain model runs no collective, so rank 0 counts alone.
    counted = flops.count_for(job, model, forward) if job.plan.layout == "dp" else None
    cfg = job.config
    # A checkpoint's Plan (rebalanced shares, shrunk micro-batches) is adopted before the model is
    # set up for it: activation checkpointing and sharding follow the plan that will run.
    resume_from = persist.find_checkpoint(job, model) if job.checkpointer is not None else None    # (collective)
    if job.checkpointer is not None:
        job.plan = persist.adopt_plan(job, resume_from)                                             # (collective)
    job.plan = checkpoint_per_plan(job, model)
    if kind == "tp":
        wrapped, job.memory_plan, oom_recovery = tp_wrap(job, model, optimizer), None, False        # (collective)
    else:
        wrapped, job.memory_plan, oom_recovery = memory.wrap_for_plan(job, model, optimizer, forward)  # (collective)
    if oom_recovery != cfg.memory.oom_recovery:       # TP: an OOM ends the attempt (runtime/layouts/tensor.py)
        job.config = cfg = replace(cfg, memory=replace(cfg.memory, oom_recovery=oom_recovery))
    job.layout = TensorLayout(loss_fn) if kind == "tp" else DataLayout(loss_fn)
    job.sync = wrapped.sync                           # DDP, FSDP2's adapter, or None (TP: nothing to sync)
    if kind != "tp":                                  # the compression this wrapper can run (comm_hooks.settle)
        job.plan = comm_hooks.settle(job.plan, request=cfg.compression.method, strategy=wrapped.strategy,
                                     backend=job.ctx.backend, world_size=job.world_size)
    job.guard = make_sync_guard(job, wrapped)
    job.model = PreparedModel(model, wrapped.forward_module, job.emulated.meter if job.emulated else None)
    job.optimizer = wrapped.optimizer                 # FSDP2/ZeRO/TP may have made a new one
    persist.check_registered(job, optimizer)          # state registered before prepare() on the replaced one: refused
    memory.show_wrapping(job.log, wrapped)
    if job.faults:                                    # injected faults strike inside the compute (devices/hooks.py)
        job.hooks.attach_faults(model, block_type=cfg.memory.blocks, sharded=wrapped.strategy == "fsdp")
    job.rebalancer = make_rebalancer(cfg, job.world_size) if job.plan.layout == "dp" else None
    if resume_from is not None:
        persist.restore(job, resume_from)                                                           # (collective)
    return counted


def prepare_pipelined(job: Job, model, optimizer, kind: str, loss_fn, given_plan: Plan | None, measured,
                      options: dict) -> None:
    """'pp' and 'dp-pp': this rank's stage of one pipeline replica (runtime/layouts/pipeline_setup.py)."""
    if measured is not None:
        parts, profile, devices = measured
    else:
        parts = find_parts(model)
        profile, devices = stages.measure_blocks(job, parts)                                          # (collective)
    profile = stages.on_clock(job, profile)
    if given_plan is not None and given_plan.layout == kind:
        job.plan = check_given_plan(job, given_plan)
    else:
        job.plan = stages.plan_pipeline(job, kind, parts, profile, devices,
                                        optimizer_kind=memory.optimizer_kind(optimizer) or "adamw", **options)
    resume_from = persist.find_checkpoint(job, model) if job.checkpointer is not None else None    # (collective)
    if job.checkpointer is not None:
        job.plan = persist.adopt_plan(job, resume_from)                                             # (collective)
    job.plan = job.precision.record_in(job.plan)
    job.layout, job.optimizer = stages.build_stage(job, model, optimizer, job.plan, parts, profile, devices,
                                                   loss_fn)                                          # (collective)
    pipe = job.layout.pipe
    job.model = stages.StagedModel(model, pipe.module, None)
    job.sync = job.guard = None                       # the pipeline syncs its own gradients; shares stay
    job.rebalancer = stages.make_resplitter(job, devices, memory.optimizer_kind(optimizer) or "adamw")  # pp: blocks move online
    persist.check_registered(job, optimizer)
    if job.emulated is not None:
        job.emulated.meter.set_fixed(pipe.module, job.optimizer)      # this stage's state, not the model's
    stages.show_split(job, pipe)
    if resume_from is not None:
        persist.restore(job, resume_from)                                                           # (collective)


def decide_auto(job: Job, model, optimizer, loss_fn) -> tuple[str, tuple | None]:
    """parallel='auto' (runtime/layouts/choose.py): the layout, and the blocks measured on the way."""
    if job.world_size == 1 or loss_fn is None:    # pipelines need the loss function: data parallel
        return "dp", None
    try:
        parts = find_parts(model)
    except UsageError as e:
        job.log.info(f"parallel=auto chose dp: no blocks found to cut pipelines between ({e.what.split(':')[0]})")
        return "dp", None
    from ..planning.parallelism import compare_parallelism

    kind_opt = memory.optimizer_kind(optimizer) or "adamw"
    factor, grad_fraction, _ = choose.model_state([model], kind_opt)     # frozen parameters: weights only
    devices = stages.device_table(job)                                                                 # (collective)
    fits, why = choose.state_fits(model, devices, factor=factor, margin=job.config.memory.margin)
    if fits:       # the common case decided without measuring anything
        job.log.info(f"parallel=auto chose dp: {why}")
        return "dp", None
    profile, devices = stages.measure_blocks(job, parts, devices)                                     # (collective)
    try:
        choice = compare_parallelism(profile, devices, global_batch=job.config.global_batch,
                                     state_factor=factor, grad_fraction=grad_fraction,
                                     memory_margin=job.config.memory.margin)
    except UsageError as e:
        raise UsageError(f"parallel='auto': {e.what}", e.fix) from None
    kind, why = choose.auto(job, model=model, optimizer_kind=kind_opt, parts=parts, profile=profile,
                            devices=devices, choice=choice)
    job.log.info(f"parallel=auto chose {kind}: {why}")
    return kind, (parts, profile, devices)


def tensor_plan(plan: Plan) -> Plan:
    """The data-parallel plan as tensor parallelism runs it: one group of every rank, each
    computing the whole batch, at the smallest micro-batch any rank planned (they run in lockstep)."""
    micro = min(d.micro_batch for d in plan.devices)
    devices = tuple(replace(d, share=plan.global_batch, micro_batch=micro, max_micro_batch=micro,
                            reasons=(f"tensor parallel: every rank computes all {plan.global_batch} samples, "
                                     f"in micro-batches of {micro} (the smallest any device planned)",))
                    for d in plan.devices)
    return replace(plan, devices=devices, layout="tp", group=plan.world_size, compression="none")


def tp_wrap(job: Job, model, optimizer):
    """The model's layers sharded over every rank, evenly or by speed, and the optimizer rebuilt
    over the sharded parameters (runtime/layouts/tensor.py; collective)."""
    from .layouts.tensor import wrap

    return wrap(job, model, optimizer)


def prepare_to_measure(job: Job, model, optimizer, dataset, collate_fn: Callable | None) -> None:
    """What measuring needs, in order; `hetrain plan`'s worker (cli/plan_worker.py) stops after it."""
    open_data(job, dataset, collate_fn)
    job.precision.agree(rank=job.rank, world_size=job.world_size, device=job.device, log=job.log)  # (collective)
    measure_setup(job, model, optimizer)


def open_data(job: Job, dataset, collate_fn: Callable | None) -> None:
    """The dataset, the global-cursor sampler and the checkpoint directory (every layout)."""
    cfg = job.config
    job.dataset, job.collate = dataset, collate_fn or default_collate
    job.sampler, job.total_steps = make_sampler(cfg, len(dataset))
    job.checkpointer = open_checkpoints(cfg, job.rank, job.log)


def measure_setup(job: Job, model, optimizer) -> None:
    """The whole model on this rank's device, counted, checkpointed as configured: what the
    data-parallel probe measures (a pipeline moves only its stage: runtime/layouts/pipeline_setup.py)."""
    model.to(job.device)
    count_model_state(job, model, optimizer)          # the emulated meter holds the model from here
    if job.config.memory.activation_checkpointing == "all":  # before the probe: measure what will run
        checkpointing.checkpoint_blocks(model, job.config.memory.blocks)


def make_sampler(cfg: Config, n: int) -> tuple[GlobalCursorSampler, int]:
    """The global-cursor sampler and the run's step count (max_steps, or the epochs)."""
    sampler = GlobalCursorSampler(n, cfg.global_batch, seed=cfg.seed, shuffle=cfg.shuffle, drop_last=cfg.drop_last)
    steps = cfg.max_steps if cfg.max_steps is not None else math.ceil(
        (cfg.epochs or 1.0) * sampler.steps_per_epoch - 1e-9)
    return sampler, steps


def open_checkpoints(cfg: Config, rank: int, log) -> Checkpointer | None:
    if not cfg.checkpoints.dir:
        return None
    return Checkpointer(cfg.checkpoints.dir, keep=cfg.checkpoints.keep, rank=rank, log=log)


def count_model_state(job: Job, model, optimizer) -> None:
    if job.emulated is not None:
        job.emulated.meter.set_fixed(model, optimizer)


def plan_split(job: Job, model, optimizer, forward, given: Plan | None, kind: str = "dp") -> tuple[Plan, tuple | None]:
    """The given plan (checked against this job), or every rank's measured profiles through the
    same pure planner (runtime/measure/joint.py). Returns the plan and the profiles it was made from."""
    if given is not None:
        return check_given_plan(job, given), None
    return plan_from_measurements(measure_job(job, model, optimizer, forward), job.config, layout=kind)


def checkpoint_per_plan(job: Job, model) -> Plan:
    """Activation checkpointing on the devices whose plan needs it; the plan records every rank's
    agreed precision and checkpointing (a record: same version)."""
    plan, _ = checkpointing.apply_from_plan(model, job.precision.record_in(job.plan), job.rank,
                                            mode=job.config.memory.activation_checkpointing, block_type=job.config.memory.blocks)
    return plan


def make_sync_guard(job: Job, wrapped):
    """The gradient sync's comm hook on DDP (runtime/sharding/comm_hooks.py: compressed as the plan
    says, through the emulated inter-node link) and OOM recovery's guard: recovery.SyncGuard, which
    calls that hook and records the buckets a backward launched (FSDP2's adapter guards itself).
    Without OOM recovery the hook alone, or DDP's own C++ all-reduce when the hook would add nothing."""
    cfg = job.config
    guard = cfg.memory.oom_recovery and job.world_size > 1
    if not isinstance(wrapped.sync, DDP):
        return wrapped.sync_guard() if guard else None
    gradient = comm_hooks.GradientHook(job.plan.compression, powersgd_rank=cfg.compression.powersgd_rank,
                                       throttle=throttle_for(job), backend=job.ctx.backend)
    return recovery.install(wrapped.sync, gradient, guard=guard)


def make_rebalancer(cfg: Config, world_size: int) -> Rebalancer | None:
    if not (cfg.rebalancing.enabled and world_size > 1):
        return None
    return Rebalancer(world_size=world_size, threshold=cfg.rebalancing.threshold, micro_batch_cap=cfg.memory.max_micro_batch)


def freeze_heap() -> None:
    """Python's full (generation-2) collection scans every live object: after the imports,
    profiling and planning that is a large heap, and one pass took ~140 ms in the middle of
    training here (a step is ~110 ms). Collect once now and freeze what is alive, so the
    collections during training look only at objects made during training (as torchtitan
    controls GC in its loop). The Engine unfreezes at close, so the wrapper can be freed."""
    gc.collect()
    gc.freeze()
