"""prepare() for the pipeline layouts, in order: measure the blocks, plan the split and shares
(or take them from a Plan), build this rank's stage and its optimizer. Lines marked (collective)
are entered by every rank."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ....errors import UsageError
from ....layout_spec import Pipeline as LayoutPipeline
from ....layout_spec import to_spec
from ....planning.parallelism import split_hybrid, stage_rows
from .split import RESPLIT_NOTE, evaluate_split, micro_batch_cut
from ....planning.plan import DevicePlan, Plan
from .probe import time_stage_cost
from .stage_hooks import of_job as stage_hooks
from . import block_cache
from .blocks import PipelineParts
from ..checks import state_factor
from .sizing import (agreed_profile, device_table, param_names, plan_split, unmeasured_profile)
from .loop import PipelineLayout

if TYPE_CHECKING:     # torch.distributed.pipelining: imported when a stage is built, not by every job
    from .schedule import Pipeline


def measure_blocks(job, parts: PipelineParts):
    """Every rank's device and the blocks' costs with how much longer a stage runs them, agreed
    (collective); where the devices' blocks are timed on this host's CPU (StageHooks.
    blocks_on_host), from the cache when this CPU measured this model before (`hetrain plan`'s
    measurement is then the one the job sizes its stages from)."""
    devices = device_table(job)                                                                       # (collective)
    example = job.load(range(min(4, len(job.dataset))))[0]
    # A stage's micro-batch grows less than linearly in cost with its rows: the probe times the
    # pipeline's own size (the global batch in 8 micro-batches, the default), not 4 rows stretched.
    rows = min(PROBE_ROWS_MAX, max(4, math.ceil(job.config.global_batch / 8)), len(job.dataset))
    probe = job.load(range(rows))[0] if rows != int(example.shape[0]) else example
    on = stage_hooks(job)
    cache = block_cache.path_for(parts, probe, job, devices) if on.blocks_on_host and job.rank == 0 else None
    box = [block_cache.read(cache)]
    dist.broadcast_object_list(box, src=0)                                                            # (collective)
    if box[0] is not None:
        return box[0], devices
    profile, devices = agreed_profile(job, parts, example, devices)                                   # (collective)
    found = time_stage_cost(parts, profile, probe, device=job.device, precision=job.precision,      # (collective)
                            stage_hooks=on)
    measured = {k: found[k] for k in ("first_s", "last_s", "host") if k in found}
    profile = dataclasses.replace(profile, stage_factor=found["factor"], block_s=found["block_s"], **measured,
                                  source=f"{profile.source}; {_stage_costs_said(found, on)}")
    if job.rank == 0:
        block_cache.write(cache, profile)
    return profile, devices


PROBE_ROWS_MAX = 16      # the stage probe's largest micro-batch (time and memory on a device that is small)


def _stage_costs_said(found: dict, on) -> str:
    """What time_stage_cost measured, in words (the profile's source)."""
    ranks = ", ".join(f"x{f:.2f} + {b * 1e3:.2f} ms" for f, b in found["ranks"])
    said = (f"a stage runs them x{found['factor']:.2f} + {found['block_s'] * 1e3:.2f} ms a block per micro-batch "
            f"(a block as a one-stage pipeline at 1 and {found['micro_batch']} rows, on each rank in turn: {ranks})")
    if "first_s" in found or "last_s" in found:
        said += (f", the first part +{found.get('first_s', 0.0) * 1e3:.2f} ms, the last with a loss piece "
                 f"+{found.get('last_s', 0.0) * 1e3:.2f} ms")
    return said + on.host_said(found.get("host") or {})


def on_clock(job, profile):
    """The blocks as this job's stages run them (StageHooks.as_run: on a clock where the device
    gives its time, PipelineProfile.on_clock; else as measured)."""
    return stage_hooks(job).as_run(profile)


def default_micro_batches(stages: int, micro_batches: int | None, *, most: int) -> int:
    """The pipeline's micro-batches per step: asked for, or 2-4 per stage (at most 8) to keep the
    bubble small, but no more than `most` (the samples of a replica's share)."""
    if micro_batches is None:
        return max(1, min(max(stages, min(4 * stages, 8)), most))
    return micro_batches            # checked when the Pipeline was made (layout_spec.py)


def plan_pipeline(job, one: bool, parts: PipelineParts, profile, devices, *, optimizer_kind: str, schedule: str,
                  stages: int | None, micro_batches: int | None) -> Plan:
    """The Plan of a pipeline layout (pure, from the agreed profile): blocks per stage, the
    replicas' shares by throughput, each replica's micro-batch size. `one`: one pipeline over
    every device (else replicas of `stages` stages, None: the best count)."""
    cfg, w = job.config, job.world_size
    factor = state_factor([*parts.blocks, parts.first, parts.last], optimizer_kind)   # frozen: weights only
    if one:
        stages = w
    elif stages is None:        # the DP×PP shape with the most predicted throughput
        stages = _best_stages(job, profile, devices, w, cfg, schedule, factor, micro_batches)
    if stages < 2 or w % stages:
        raise UsageError(f"Pipeline(stages={stages}): {w} devices do not form pipelines of {stages} stages",
                         f"use a stage count that divides {w}: {', '.join(str(k) for k in range(2, w + 1) if w % k == 0)}")
    if stages > profile.n_blocks:
        raise UsageError(f"{stages} pipeline stages but the model has {profile.n_blocks} block(s)",
                         f"use at most {profile.n_blocks} stages (parallel=hetrain.Pipeline(stages=k) with fewer stages), or a model with more blocks")
    m = default_micro_batches(stages, micro_batches, most=cfg.global_batch // (w // stages))
    common = dict(schedule=schedule, state_factor=factor, memory_margin=cfg.memory.margin)
    if one:
        mu, n = micro_batch_cut(cfg.global_batch, m, stages=stages, schedule=schedule)
        split = plan_split(profile, devices, None, micro_batches=n, micro_batch_size=mu, **common)
        splits, shares, reasons = [split], (cfg.global_batch,), (*split.reasons, *_resplit_reason(cfg, one))
    else:
        h = split_hybrid(profile, devices, stages=stages, global_batch=cfg.global_batch, micro_batches=m, **common)
        splits, shares, reasons = h.replicas, h.shares, (*h.reasons, *_resplit_reason(cfg, one))
    predicted = predict_step(job, splits, profile)
    plans = []
    for r, dev in enumerate(devices):
        replica, stage = divmod(r, stages)
        share = shares[replica]
        if share < 1:
            raise UsageError(f"replica {replica} gets no samples of the global batch {cfg.global_batch}",
                             "use a larger global batch, or fewer replicas (more stages)")
        st = splits[replica].stages[stage]
        plans.append(DevicePlan(
            rank=r, device=dev.name, speed=dev.speed, share=share,
            micro_batch=micro_batch_cut(share, m, stages=stages, schedule=schedule)[0],   # n_micro: ⌈share/µ⌉
            memory_cap_bytes=int(dev.memory_bytes) if dev.memory_bytes else None,
            predicted_memory_bytes=int(st.memory_bytes),
            reasons=(f"stage {stage} of replica {replica}: blocks {st.start}-{st.stop - 1}", *reasons)))
    spec = LayoutPipeline(stages=None if one else stages, micro_batches=m, schedule=schedule)
    kind = spec.kind_for(w)
    return Plan(global_batch=cfg.global_batch, devices=tuple(plans), layout=kind, layout_spec=to_spec(spec), group=stages,
                stage_blocks=splits[0].sizes, schedule=schedule, predicted=predicted,
                note=f"{kind}: " + "; ".join(reasons[:2]) if reasons else kind)


def predict_step(job, splits, profile=None) -> dict:
    """The pipeline's own prediction from the measured blocks (the slowest replica sets the step),
    kept in the plan as data parallelism's is: the run's summary reports it beside the measured.
    Where the stages share a host, what it adds (StageHooks.predicted_step, from the figures the
    pipeline probe measured: PipelineProfile.host)."""
    step_s = max(sp.step_seconds for sp in splits)
    if not step_s > 0:
        return {}
    predicted = {"samples_per_s": job.config.global_batch / step_s, "step_s": step_s}
    predicted.update(stage_hooks(job).predicted_step(splits, profile, step_s=step_s,
                                                      global_batch=job.config.global_batch))
    return predicted


def _best_stages(job, profile, devices, w, cfg, schedule, factor, micro_batches) -> int:
    """The stage count of Pipeline(stages='auto'): the chooser's (planning/chooser.py) among the
    DP×PP shapes (parallelism.stage_rows), what the stages share (StageHooks.shared_host) counted
    as the ranking and predict_step count it."""
    from ....planning.chooser import Request, choose
    from ....planning.options import PlanOptions

    o = PlanOptions(global_batch=cfg.global_batch, memory_margin=cfg.memory.margin)
    host = stage_hooks(job).shared_host()
    rows = stage_rows(profile, devices, o, schedule=schedule, state_factor=factor, host=host,
                      micro_batches=lambda p: default_micro_batches(p, micro_batches, most=cfg.global_batch // (w // p)))
    best = choose(rows, Request(families=("DP×PP",))).row
    if best is None:
        raise UsageError("Pipeline(stages='auto'): no shape of replicas fits: "
                         + "; ".join(f"{r.name}: {r.detail}" for r in rows),
                         "use Pipeline() (one pipeline), activation checkpointing, or smaller micro-batches")
    return best.stages


def stage_split(plan: Plan, parts: PipelineParts, profile, devices, replica: int):
    """This replica's PipelineSplit for the plan's blocks per stage (its bounds and schedule)."""
    profile = profile or unmeasured_profile(parts)
    group = devices[replica * plan.group:(replica + 1) * plan.group]
    me = plan.devices[replica * plan.group]
    return evaluate_split(profile, group, plan.stage_blocks, micro_batches=me.n_micro,
                          micro_batch_size=me.micro_batch, schedule=plan.schedule or "1f1b")


def build_stage(job, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan, parts: PipelineParts,
                profile, devices, loss_fn) -> tuple[PipelineLayout, torch.optim.Optimizer]:
    """This rank's stage of the plan (collective: process groups), and its optimizer: the user's
    optimizer class and hyperparameters over the stage's parameters."""
    stages, replicas = plan.group, plan.replicas
    replica, stage = divmod(job.rank, stages)
    grid = [[r * stages + s for s in range(stages)] for r in range(replicas)]
    pp_group, dp_group = _groups(job, grid) if replicas > 1 else (None, None)                        # (collective)
    from .schedule import Pipeline
    pipe = Pipeline(parts=parts, names=param_names(model), split=stage_split(plan, parts, profile, devices, replica),
                    stage_index=stage, rank_grid=grid, replica=replica, loss_fn=loss_fn, device=job.device,
                    stage_hooks=stage_hooks(job), precision=job.precision, faults=job.faults,
                    pp_group=pp_group, dp_group=dp_group, timeout_s=job.config.timeout_s)
    pipe.profile = profile
    # Each param group's parameters by whole-model name (all stages'): the checkpoint's groups are
    # then the same on every rank, and what a data-parallel resume expects.
    names = param_names(model)
    pipe.group_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    layout = PipelineLayout(plan.layout, loss_fn, pipe)
    return layout, stage_optimizer(optimizer, pipe)


def _groups(job, grid):
    """This rank's pipeline group (its replica's stages) and data-parallel group (its stage in every
    replica): the (dp, pp) mesh's rows and columns, made with the job's collective timeout (a group
    made without one waits torch's default 30 minutes for a hung peer). Every rank makes every group,
    in the same order, as torch requires."""
    from datetime import timedelta

    import torch.distributed as dist

    from ...ranks.islands import for_job as island_layout
    from ...ranks.islands import pipeline_groups as island_pipeline_groups

    timeout = timedelta(seconds=job.config.timeout_s)
    islands = island_layout(job)            # ranks on 2+ device islands: DP inside each, PP across
    if islands is not None:
        return island_pipeline_groups(islands, grid, rank=job.rank, timeout=timeout)
    mine = {}
    for r, ranks in enumerate(grid):
        group = dist.new_group(ranks, timeout=timeout)
        if job.rank in ranks:
            mine["pp"] = group
    for s in range(len(grid[0])):
        ranks = [row[s] for row in grid]
        group = dist.new_group(ranks, timeout=timeout)
        if job.rank in ranks:
            mine["dp"] = group
    return mine["pp"], mine["dp"]


# Why DP×PP keeps its planned split (the plan's reasons say it, and the job's log when it starts).
NO_RESPLIT_HYBRID = ("no online re-split under DP×PP: the replicas average their gradients stage by stage, "
                     "so every replica's stage must keep the same blocks; the split stays as planned "
                     "(parallel='pp' re-splits online)")


def _resplit_reason(cfg, one: bool) -> tuple[str, ...]:
    if not cfg.rebalancing.enabled:
        return ()
    return (RESPLIT_NOTE + "; Rebalancing(enabled=False) keeps this split",) if one else (NO_RESPLIT_HYBRID,)


def make_resplitter(job, devices, optimizer_kind: str):
    """Pipeline(): what moves blocks between stages when a stage's measured speed changes
    (runtime/layouts/pipeline/resplit.py), with the job's rebalance settings; None under DP×PP (its
    replicas share one split: pipeline_layouts.HybridSetup says so), with
    Rebalancing(enabled=False), or on one device."""
    cfg, plan, pipe = job.config, job.plan, job.layout.pipe
    if not cfg.rebalancing.enabled or plan.replicas > 1 or plan.world_size < 2 or pipe.profile is None:
        return None
    from .resplit import Resplitter, Sizing

    parts = pipe.parts
    factor = state_factor([*parts.blocks, parts.first, parts.last], optimizer_kind)
    sizing = Sizing(profile=pipe.profile, devices=tuple(devices), schedule=plan.schedule or "1f1b",
                    state_factor=factor, memory_margin=cfg.memory.margin)

    def move(split, version: int) -> str | None:      # a collective of the pipeline
        why = pipe.resplit(split, job.optimizer, version=version)
        meter = job.hooks.meter      # a device that counts its own bytes: the stage's new state counts now
        if why is None and meter is not None:
            meter.set_fixed(pipe.module, job.optimizer)
        return why

    return Resplitter(sizing=sizing, sizes=plan.stage_blocks, move=move, log=job.log,
                      threshold=cfg.rebalancing.threshold)


def stage_optimizer(optimizer: torch.optim.Optimizer, pipe: Pipeline) -> torch.optim.Optimizer:
    from ...sharding.wrap import rebuild_optimizer

    return rebuild_optimizer(optimizer, {p: p for p in pipe.parameters()}, who="a pipeline",
                             over="this stage's parameters", otherwise="")
