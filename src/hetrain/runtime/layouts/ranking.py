"""Every layout ranked on what this job measures: the one function `hetrain plan --model-factory`
(cli/plan_worker.py) and prepare(parallel='auto') (choose.decide) both measure with, so both rank
the same measurements with the same measurements.rank_job_measurements and agree on the best.

measure_for_ranking (collective, every rank) takes, in order: the data-parallel measurements
(measure/joint.measure_job: profiles, sync and agreement probes), the blocks' costs as a pipeline
is sized from them (pipeline_setup.measure_blocks, when the model's blocks can be cut and there
are 2+ devices), FSDP2's excess over a DDP step (measure/fsdp_probe.py, when there are blocks
to shard), and, with time_tp (`hetrain plan`; auto when it may run TP), a step of the model split by speed
(layouts/tensor/probe.py, when it has layers to split and the ranks one precision). The model must be set up for measuring first (data_setup.measure_setup).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from ...errors import UsageError
from ..measure.joint import measure_job
from ..measure.measurements import Measurements


@dataclass(frozen=True, kw_only=True)
class JobMeasurements:
    measurements: Measurements         # with .pipeline and .fsdp filled where measured
    facts: dict                        # model_facts: what each layout's memory divides
    blocks: int | None                 # blocks to cut pipelines between (None: not known)
    pipeline_parts: tuple | None       # (parts, profile, devices) as measured, for the pipeline's plan
    stack: tuple | None = None         # blocks.repeated_blocks(model), when there was one


def measure_for_ranking(job, model, optimizer, forward, *, say=None, time_tp: bool = False) -> JobMeasurements:
    """What the ranking needs, measured in this job (collective: every rank calls it). `time_tp`:
    also time the TP split by speed (`hetrain plan`, whose table shows its row, and parallel='auto'
    wherever it may run TP: choose.decide), so both cost that row alike."""
    from .pipeline.blocks import find_parts, repeated_blocks
    from .pipeline import setup as pipeline_setup

    say = say or job.log.detail          # what was measured: a reason, under --verbose
    measured = measure_job(job, model, optimizer, forward)                                          # (collective)
    try:
        parts = find_parts(model)
    except UsageError:                        # a model no one here wrote: no cuts, but maybe a stack
        parts = None
    pipeline_parts = None
    if job.world_size > 1 and parts is not None:
        profile, devices = pipeline_setup.measure_blocks(job, parts)                                 # (collective)
        say(f"pipeline blocks measured: {profile.source}")
        pipeline_parts = (parts, profile, devices)
        measured = dataclasses.replace(measured, pipeline={
            "profile": profile.to_dict(),
            "devices": [{"name": d.name, "speed": d.speed, "memory_bytes": d.memory_bytes} for d in devices]})
    measured = _with_fsdp(job, model, optimizer, measured, forward, say)                            # (collective)
    if time_tp:
        measured = _with_tp(job, model, optimizer, measured, forward, say)                          # (collective)
    stack = repeated_blocks(model)
    blocks = len(parts.blocks) if parts is not None else len(stack[1]) if stack else None
    return JobMeasurements(measurements=measured, facts=model_facts(model, optimizer, blocks, stack=stack),
                           blocks=blocks, pipeline_parts=pipeline_parts, stack=stack)


def _with_fsdp(job, model, optimizer, measured, forward, say):
    """The measurements plus what FSDP2 adds to a step here (measure/fsdp_probe.py: collective,
    every rank), when there are blocks to shard and devices to shard them over."""
    from ..measure.fsdp_probe import time_fsdp_excess
    from ..measure.measurements import plan_from_measurements
    from ..memory.activation_checkpointing import find_blocks

    blocks = [name for name, _ in find_blocks(model, job.config.memory.blocks)]
    if job.world_size < 2 or not blocks or not measured.probe_size:
        return measured
    # Each rank its micro-batch of the data-parallel plan the FSDP2 row adds the excess to: with
    # uneven rows, every unit's collectives hold the ranks to the one with the most CPU a unit while
    # each device takes its own time beyond its CPU's, so the excess depends on the shares (equal rows
    # read +117 ms against +164 ms run at shares 20/12 on the dilated pair: FSDP2 wall +15%).
    try:
        rows = [d.micro_batch for d in plan_from_measurements(measured, job.config)[0].devices]
    except UsageError:
        rows = []
    if len(rows) != job.world_size:          # no data-parallel plan of every rank: the probe's rows
        rows = [measured.probe_size] * job.world_size
    batch = job.load(range(min(rows[job.rank], len(job.dataset))))
    found = time_fsdp_excess(model, optimizer, blocks, batch, forward=forward, device=job.device,
                             precision=job.precision.compute,
                             measuring=job.hooks.measuring())
    # Each rank timed its own steps: every rank ranks with rank 0's (what `hetrain plan` writes),
    # so all of them choose the same layout.
    box = [found]
    dist.broadcast_object_list(box, src=0)                                                            # (collective)
    found = box[0]
    say(f"FSDP2 measured: a step {found['fsdp_s'] * 1e3:.0f} ms against DDP's {found['ddp_s'] * 1e3:.0f} ms "
        f"({'/'.join(map(str, rows))} samples by rank, the data-parallel plan's; median of {found['runs']})")
    return dataclasses.replace(measured, fsdp={**found, "rows": rows, "backend": measured.backend})


def model_facts(model, optimizer, blocks, *, stack=False) -> dict:
    """What every layout's memory divides (planning/ranking.ModelState): all parameters, those
    that train, their element sizes, the optimizer, and the parameters outside the blocks.
    `stack`: blocks.repeated_blocks(model) when the caller has it (False: found here)."""
    from ..memory.device_memory import optimizer_kind
    from .pipeline.blocks import repeated_blocks

    params = list(model.parameters())
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    stack = repeated_blocks(model) if stack is False else stack
    inside = sum(p.numel() for b in stack[1] for p in b.parameters()) if stack else 0
    return {"params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in train),
            "param_bytes": train[0].element_size() if train else 4,
            "frozen_param_bytes": frozen[0].element_size() if frozen else 4,
            "optimizer": optimizer_kind(optimizer) or "adamw", "blocks": blocks,
            "root_params": sum(p.numel() for p in params) - inside if stack else 0, **tp_facts(model)}


def tp_facts(model) -> dict:
    """What the TP rows cost by (planning/ranking.ModelState): why TP cannot split this model, or
    its all-reduced bytes per byte of activations from the pairs it splits (tensor/split.tp_comm_ratio),
    found by the rule the runtime splits by (layouts/tensor/styles.find_splits)."""
    from .tensor.hf import is_hf
    from .tensor.styles import find_splits
    from .tensor.split import tp_comm_ratio

    if is_hf(model):              # split by the plan the model declares (layouts/tensor/hf.py): a transformer
        return {}
    try:
        splits = find_splits(model)
    except UsageError as e:       # the runtime would refuse it: its own reason, not a costed row
        return {"tp_refused": f"tensor parallelism cannot split this {type(model).__name__}: {e.what}"}
    modules = dict(model.named_modules())
    widths = [(s.kind, modules[s.rowwise].out_features, sum(modules[c].out_features for c in s.colwise))
              for s in splits]
    return {"tp_comm_per_activation": tp_comm_ratio(widths), "tp_pairs": len(splits)}


def _with_tp(job, model, optimizer, measured, forward, say):
    """The measurements plus a step of the model split by speed (layouts/tensor/probe.py: collective,
    every rank), when there are devices to split it over and one precision for all of them (TP
    runs its shards in lockstep, in one dtype: layouts/tensor.wrap). A model without layers to
    split is left out on every rank alike (shard decides from the model, the same everywhere)."""
    from ..measure.measurements import planning_profiles
    from .tensor.probe import time_tp_step
    from .tensor.split import speed_fractions, tp_micro_batch

    computes = {e["compute"] for e in job.precision.all_choices}
    if job.world_size < 2 or not measured.probe_size or len(computes) > 1:
        return measured
    profiles = planning_profiles(measured, job.config)
    fastest = min(p.per_sample_s for p in profiles)
    speeds = [fastest / p.per_sample_s for p in profiles]
    # at the micro-batch the runtime would run (the row's: tp_micro_batch), so nothing is scaled
    rows, _ = tp_micro_batch(profiles, speed_fractions([p.per_sample_s for p in profiles]),
                             global_batch=job.config.global_batch, margin=job.config.memory.margin,
                             limit=job.config.memory.max_micro_batch)
    if rows < 1:
        return measured                      # not one sample fits a part: the row says so, unmeasured
    batch = job.load(range(min(rows, len(job.dataset))))
    try:
        found = time_tp_step(model, optimizer, batch, forward=forward, device=job.device,
                             precision=job.precision.compute, speeds=speeds,
                             measuring=job.hooks.measuring())
    except UsageError:
        return measured
    box = [found]
    dist.broadcast_object_list(box, src=0)                                                            # (collective)
    found = box[0]
    say(f"TP split by speed measured: a micro-batch of {found['micro_batch']} {found['fb_s'] * 1e3:.0f} ms "
        f"forward and backward, the optimizer {found['opt_s'] * 1e3:.1f} ms (median of {found['runs']})")
    return dataclasses.replace(measured, tp=found)
