"""prepare(), in order: small functions over the job record (job.py), each taking what it needs
and returning what it makes. `prepare_job` is the whole order in one place; the comment on each
line says why it comes where it does. Lines marked (collective) are entered by every rank.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch.utils.data import default_collate

from ..planning.plan import Plan
from .memory import activation_checkpointing as checkpointing
from .memory import device_memory as memory
from .resilience import resume as persist
from .resilience.store import Checkpointer
from .config import Config
from .loop.sampler import GlobalCursorSampler
from .job import Job
from .measure.joint import check_given_plan, measure_job, show_plan
from .measure.measurements import plan_from_measurements
from .model import PreparedModel
from .resilience.rebalance import Rebalancer


def prepare_job(job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                collate_fn: Callable | None, forward: Callable, given_plan: Plan | None) -> None:
    prepare_to_measure(job, model, optimizer, dataset, collate_fn)                                 # (collective)
    job.plan, job.profiles = plan_split(job, model, optimizer, forward, given_plan)                 # (collective)
    cfg = job.config
    # A checkpoint's Plan (rebalanced shares, shrunk micro-batches) is adopted before the model is
    # set up for it: activation checkpointing and sharding follow the plan that will run.
    resume_from = persist.find_checkpoint(job, model) if job.checkpointer is not None else None    # (collective)
    if job.checkpointer is not None:
        job.plan = persist.adopt_plan(job, resume_from)                                             # (collective)
    job.plan = checkpoint_per_plan(job, model)
    wrapped, job.memory_plan, oom_recovery = memory.wrap_for_plan(job, model, optimizer, forward)  # (collective)
    if oom_recovery != cfg.oom_recovery:              # the wrapper may turn in-loop OOM recovery off (runtime/memory/device_memory.py)
        job.config = cfg = replace(cfg, oom_recovery=oom_recovery)
    job.sync = wrapped.sync                           # DDP, or FSDP2's adapter
    job.guard = make_sync_guard(cfg, job.world_size, wrapped)
    job.model = PreparedModel(model, wrapped.forward_module, job.emulated.meter if job.emulated else None)
    job.optimizer = wrapped.optimizer                 # FSDP2/ZeRO may have made a new one
    persist.check_registered(job, optimizer)          # state registered before prepare() on the replaced one: refused
    memory.show_wrapping(job.log, wrapped)
    if job.faults:                                    # injected faults strike inside the compute (devices/hooks.py)
        job.hooks.attach_faults(model, block_type=cfg.checkpoint_blocks, sharded=wrapped.strategy == "fsdp")
    job.rebalancer = make_rebalancer(cfg, job.world_size)
    if resume_from is not None:
        persist.restore(job, resume_from)                                                           # (collective)
    show_plan(job.log, job.plan, job.total_steps)
    job.log.flush()                                   # every rank's setup warnings, once     (collective)
    freeze_heap()


def prepare_to_measure(job: Job, model, optimizer, dataset, collate_fn: Callable | None) -> None:
    """What measuring needs, in order; `hetrain plan`'s worker (cli/plan_worker.py) stops after it."""
    cfg = job.config
    model.to(job.device)
    job.dataset, job.collate = dataset, collate_fn or default_collate
    job.sampler, job.total_steps = make_sampler(cfg, len(dataset))
    job.checkpointer = open_checkpoints(cfg, job.rank, job.log)
    count_model_state(job, model, optimizer)          # the emulated meter holds the model from here
    job.precision.agree(rank=job.rank, world_size=job.world_size, device=job.device, log=job.log)  # (collective)
    if cfg.checkpointing == "all":                    # before the probe: measure what will run
        checkpointing.checkpoint_blocks(model, cfg.checkpoint_blocks)


def make_sampler(cfg: Config, n: int) -> tuple[GlobalCursorSampler, int]:
    """The global-cursor sampler and the run's step count (max_steps, or the epochs)."""
    sampler = GlobalCursorSampler(n, cfg.global_batch, seed=cfg.seed, shuffle=cfg.shuffle, drop_last=cfg.drop_last)
    steps = cfg.max_steps if cfg.max_steps is not None else math.ceil(
        (cfg.epochs or 1.0) * sampler.steps_per_epoch - 1e-9)
    return sampler, steps


def open_checkpoints(cfg: Config, rank: int, log) -> Checkpointer | None:
    if not cfg.checkpoint_dir:
        return None
    return Checkpointer(cfg.checkpoint_dir, keep=cfg.keep_checkpoints, rank=rank, log=log)


def count_model_state(job: Job, model, optimizer) -> None:
    if job.emulated is not None:
        job.emulated.meter.set_fixed(model, optimizer)


def plan_split(job: Job, model, optimizer, forward, given: Plan | None) -> tuple[Plan, tuple | None]:
    """The given plan (checked against this job), or every rank's measured profiles through the
    same pure planner (runtime/measure/joint.py). Returns the plan and the profiles it was made from."""
    if given is not None:
        return check_given_plan(job, given), None
    return plan_from_measurements(measure_job(job, model, optimizer, forward), job.config)


def checkpoint_per_plan(job: Job, model) -> Plan:
    """Activation checkpointing on the devices whose plan needs it; the plan records every rank's
    agreed precision and checkpointing (a record: same version)."""
    plan, _ = checkpointing.apply_from_plan(model, job.precision.record_in(job.plan), job.rank,
                                            mode=job.config.checkpointing, block_type=job.config.checkpoint_blocks)
    return plan


def make_sync_guard(cfg: Config, world_size: int, wrapped):
    """recovery.SyncGuard on DDP (FSDP2's adapter guards itself): a comm hook that records the
    buckets a backward launched. Only when OOM recovery needs it: else DDP's own C++ all-reduce."""
    return wrapped.sync_guard() if cfg.oom_recovery and world_size > 1 else None


def make_rebalancer(cfg: Config, world_size: int) -> Rebalancer | None:
    if not (cfg.rebalance and world_size > 1):
        return None
    return Rebalancer(world_size=world_size, threshold=cfg.rebalance_threshold, micro_batch_cap=cfg.micro_batch)


def freeze_heap() -> None:
    """Python's full (generation-2) collection scans every live object: after the imports,
    profiling and planning that is a large heap, and one pass took ~140 ms in the middle of
    training here (a step is ~110 ms). Collect once now and freeze what is alive, so the
    collections during training look only at objects made during training (as torchtitan
    controls GC in its loop). The Engine unfreezes at close, so the wrapper can be freed."""
    gc.collect()
    gc.freeze()
