"""prepare(), in order: small functions over the job record (job.py), each taking what it needs
and returning what it makes. `prepare_job` is the whole order in one place, the same for every
layout: the layout object (layout_spec.py) has one class behind the Layout protocol
(runtime/layouts/protocol.py) that owns its check, plan and build steps, so nothing here asks
which layout it is. The comment on each line says why it comes where it does. Lines marked
(collective) are entered by every rank.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import torch
from torch.utils.data import default_collate

from .devices import clock as clocks
from ..layout_spec import DataParallel, Pipeline, TensorParallel
from ..planning.compression import check_request as check_compression_request
from ..planning.plan import Plan
from .config import Config
from .job import Job
from .layouts import choose
from .layouts.data_setup import DataSetup, TensorSetup, measure_setup
from .layouts.pipeline.layout import HybridSetup, PipelineSetup
from .layouts.protocol import Layout
from .loop import flops, metrics
from .loop.workers import MicroBatchReader
from .loop.sampler import GlobalCursorSampler
from .loop.stream import is_stream, open_stream
from .measure.joint import show_plan
from .measure.model_call import probe as probe_model_call
from .replan import replan
from .resilience import resume as persist
from .resilience.store import Checkpointer


def prepare_job(job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset, *,
                collate_fn: Callable | None, forward: Callable, given_plan: Plan | None, parallel="auto",
                loss_fn: Callable | None = None) -> None:
    held = hold_heap()
    # a shorthand or a Plan: its layout object, or 'auto'; a plan for another layout is refused here
    spec, given_plan = choose.resolve(parallel, given_plan, world_size=job.world_size)
    open_data(job, dataset, collate_fn)
    job.precision.agree(rank=job.rank, world_size=job.world_size, device=job.device, log=job.log)  # (collective)
    # Can hetrain call the model itself? If not, data parallelism plans from the user's first steps,
    # and 'auto' (whose ranking measures the model) is DataParallel(). Pipelines and TP place the
    # model themselves (never whole on one device) and call it through loss_fn.         (collective)
    if spec == "auto" or isinstance(spec, DataParallel):
        if probe_model_call(job, model, forward) is not None:
            spec = DataParallel() if spec == "auto" else spec
    # 'auto': every layout ranked on this job's measurements, as `hetrain plan` ranks them      (collective)
    spec, measured = choose.decide(job, spec, model, optimizer, forward, loss_fn)
    layout = setup_for(spec, loss_fn, world_size=job.world_size)   # the layout's own check, plan and build
    layout.check(job)                                 # what the layout needs of this job: before anything is built
    check_compression_request(job.config.compression.method, backend=job.ctx.backend, blocked_by=layout.blocks_compression)
    counted = layout.plan(job, model, optimizer, forward, given_plan, measured)                    # (collective)
    # A checkpoint's Plan (rebalanced shares, shrunk micro-batches, a moved split) is adopted before
    # the model is built for it: checkpointing, sharding and stages follow the plan that will run,
    # with this job's records (the layout completes it as it completed its own).
    resume_from = persist.find_checkpoint(job, model) if job.checkpointer is not None else None    # (collective)
    if job.checkpointer is not None:
        replan(job, persist.adopt_plan(job, resume_from), "resumed",                                # (collective)
               complete=lambda plan: layout.complete(job, model, optimizer, forward, plan))
    layout.build(job, model, optimizer, forward)      # wrapped or staged, and the loop's layout     (collective)
    if resume_from is not None:
        persist.restore(job, resume_from)                                                           # (collective)
    job.flops = flops.agree_flop_facts(job, counted)  # MFU's parts, on every rank            (collective)
    show_plan(job.log, job.plan, job.total_steps, computes={      # where a device computes in another precision
        e["device"]: e["compute"] for e in job.precision.all_choices if e["compute"] != e["precision"]})
    job.log.info(f"layout: {layout.describe(job)}")
    job.recorder = metrics.open_recorder(job)         # rank 0: metrics.jsonl (a restart appends), status lines
    job.log.flush()                                   # every rank's setup warnings, once     (collective)
    job.run.met_at = clocks.host()                  # the first step's period starts here, on every rank
    freeze_heap(held)


def setup_for(spec, loss_fn, *, world_size: int) -> Layout:
    """The Layout class (runtime/layouts/protocol.py) of a layout object (layout_spec.py): one per
    layout, a Pipeline's by whether it is one pipeline over every device or DP×PP's replicas."""
    if isinstance(spec, Pipeline):
        return (PipelineSetup if spec.one_pipeline(world_size) else HybridSetup)(spec, loss_fn)
    return {DataParallel: DataSetup, TensorParallel: TensorSetup}[type(spec)](spec, loss_fn)


def prepare_to_measure(job: Job, model, optimizer, dataset, collate_fn: Callable | None) -> None:
    """What measuring needs, in order; `hetrain plan`'s worker (cli/plan_worker.py) stops after it."""
    open_data(job, dataset, collate_fn)
    job.precision.agree(rank=job.rank, world_size=job.world_size, device=job.device, log=job.log)  # (collective)
    measure_setup(job, model, optimizer)


def open_data(job: Job, dataset, collate_fn: Callable | None) -> None:
    """The dataset, the global-cursor sampler and the checkpoint directory (every layout)."""
    cfg = job.config
    job.dataset, job.collate = dataset, collate_fn or default_collate
    if is_stream(dataset):   # an IterableDataset: read in order, samples by position (collective)
        job.run.sampler, job.dataset, job.run.total_steps = open_stream(cfg, dataset, job.log)
        if cfg.num_workers:
            job.log.info(f"num_workers={cfg.num_workers}: a stream is read in this process (its samples arrive "
                         "step by step, a worker would not see them)")
    else:
        job.run.sampler, job.run.total_steps = make_sampler(cfg, len(dataset))
        if cfg.num_workers:      # micro-batches read by worker processes, kept across steps
            job.reader = MicroBatchReader(dataset, job.collate, num_workers=cfg.num_workers, device=job.device)
    job.checkpointer = open_checkpoints(cfg, job.rank, job.log)


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


def hold_heap() -> bool:
    """Freeze the heap as prepare() starts, unless something froze it already (a fork server's
    preload): the collections that free the measurement's temporary DDP and FSDP wrappers then
    scan what prepare() made, not the libraries' ~300k objects again (~0.2 s of CPU each). Nothing
    is collected here: freeze_heap() unfreezes what this froze and collects once, in full."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def freeze_heap(held: bool = False) -> None:
    """Python's full (generation-2) collection scans every live object: after the imports,
    profiling and planning that is a large heap, and one pass took ~140 ms in the middle of
    training here (a step is ~110 ms). Collect once now and freeze what is alive, so the
    collections during training look only at objects made during training (as torchtitan
    controls GC in its loop). The Engine unfreezes at close, so the wrapper can be freed before
    the process group is left.
    `held`: hold_heap() froze the heap at prepare()'s start; unfrozen first, so that it is collected."""
    if held:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
