"""Data parallelism across pipeline replicas (DP × PP) on a 2-D (dp, pp) device mesh.

    ht = hetrain.init(global_batch=64)
    pp = hybrid.prepare(ht, model, loss_fn=loss, stages=2, micro_batches=4, example=x[:4])
    opt = torch.optim.AdamW(pp.parameters())
    for x, y in batches:                      # the same global batch on every rank
        loss = pp.step(x, y)                  # this replica's share, through its pipeline
        opt.step(); opt.zero_grad()

Ranks r·p … r·p + p − 1 form replica r (a row of the mesh; `pp` groups run the pipelines, `dp`
groups join the same stage of every replica). On a mixed machine the replicas differ in speed,
so they get different shares of the global batch, in proportion to each pipeline's throughput
(1 / its slowest stage) — data parallelism's hetero shares, applied to whole pipelines. Every
replica uses one split of the blocks (the dp all-reduce averages the same parameters stage by
stage); the planner picks the split that maximises the replicas' total throughput.

The math is runtime/loop/reduce.py's: micro-batch k of replica r (n_rk real rows of the step's N)
weights its mean loss by loss_factor = D·n_rk/N, and the dp all-reduce sums and divides by D,
so every stage's gradient is Σ_rk (n_rk/N)∇L_rk, the big-batch gradient. A tied weight is first
summed over its stages within the replica, then averaged over replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..errors import UsageError
from ..planning.memory import ADAMW_STATE_FACTOR
from ..planning.parallelism import evaluate_hybrid, split_hybrid
from ..planning.plan import split_evenly
from .blocks import PipelineParts, find_parts
from .pipeline import Pipeline
from .pipeline_sizing import (NOT_MEASURED, agreed_profile, check_pipeline_config, device_table, param_names, show,
                              unmeasured_profile, warn_if_over)


def prepare(ht, model: nn.Module | PipelineParts, *, loss_fn: Callable, stages: int,
            micro_batches: int | None = None, schedule: str = "1f1b", example: torch.Tensor | None = None,
            split: Sequence[int] | str | None = None, shares: Sequence[int] | None = None,
            state_factor: float = ADAMW_STATE_FACTOR) -> Pipeline:
    """Run `model` as W/stages pipeline replicas of `stages` stages each, and return this rank's
    stage. `split`: None (measure the blocks on `example`; the split maximising total throughput),
    'uniform', or blocks per stage. `shares`: samples per replica (default: by throughput).
    Every rank calls it with the same arguments (a collective)."""
    w = ht.world_size
    if stages < 1 or w % stages:
        raise UsageError(f"{w} ranks do not form pipelines of {stages} stages",
                         f"use a stage count that divides {w} (e.g. {_divisors(w)})")
    parts = find_parts(model)
    m = check_pipeline_config(ht, schedule, micro_batches, stages)
    d = w // stages
    devices = device_table(ht)
    if split is None or example is not None:
        profile, devices = agreed_profile(ht, parts, example, devices)
    else:
        profile = unmeasured_profile(parts)
    common = dict(stages=stages, global_batch=ht.config.global_batch, micro_batches=m, schedule=schedule,
                  state_factor=state_factor, memory_margin=ht.config.memory_margin)
    if split is None and shares is None:
        plan = split_hybrid(profile, devices, **common)
    else:
        if split is None:
            split = split_hybrid(profile, devices, **common).sizes
        elif split == "uniform":
            split = split_evenly(profile.n_blocks, stages) if stages <= profile.n_blocks else (1,) * stages
        plan = evaluate_hybrid(profile, devices, split, shares=shares, **common)
        warn_if_over(ht, plan.replicas)

    mesh = init_device_mesh(ht.device.type, (d, stages), mesh_dim_names=("dp", "pp"))
    replica, stage = divmod(ht.rank, stages)           # the mesh's row-major rank layout
    grid = [[r * stages + s for s in range(stages)] for r in range(d)]
    pp = Pipeline(parts=parts, names=param_names(model), split=plan.replicas[replica], stage_index=stage,
                  rank_grid=grid, replica=replica, shares=plan.shares, global_batch=ht.config.global_batch,
                  loss_fn=loss_fn, device=ht.device, emulated=ht.emulated,
                  pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"))
    pp.mesh, pp.profile = mesh, profile
    if ht.emulated is not None:
        ht.emulated.meter.set_fixed(pp.module, None)
    show(ht, f"DP×PP: {d} replicas × {stages} stages, {schedule}, {m} micro-batches per replica",
         plan.replicas, plan.reasons, measured=profile.source != NOT_MEASURED)
    return pp


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
