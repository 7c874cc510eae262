"""`hetrain plan --model-factory`'s worker: the runtime's own measurements, in the job's processes.

`hetrain plan` launches this module as `hetrain run` launches a script (launch.py: torchrun, one
process per GPU or emulated device), so every rank joins the job as hetrain.init() does and
measures what Engine.prepare measures before it plans: the same job record, the same
joint_plan.measure_job (profiles, all-gather, sync and agreement probes). Rank 0 then writes the
measurements and the job's config; the CLI turns them into the Plan with the same pure
plan_from_measurements the runtime calls. No training step is taken.

    python -m hetrain.cli.plan_worker JOB.json
    JOB.json: {"factory": "script.py:make", "config": {hetrain.init keywords}, "out": "result.json"}
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    # The command's stdout is the plan (`hetrain plan --json`); what the ranks print goes to stderr.
    os.dup2(2, 1)
    with open(argv[0]) as f:
        job = json.load(f)

    from ..errors import UsageError
    from ..files import write_json_atomic
    from ..runtime.engine import init
    from ..runtime.measure.factory import call_factory, load_factory
    from ..runtime.measure.joint import measure_job
    from ..runtime.user_objects import default_forward
    from ..runtime.setup import prepare_to_measure

    ht = init(**job["config"])          # from here on, an explained error is one line from the launcher
    spec = job["factory"]
    model, optimizer, dataset, collate = call_factory(load_factory(spec), spec)
    # Engine.prepare's own first steps (precision agreed by all ranks, blocks checkpointed when the
    # job checkpoints all of them), then its measurements: the same functions, in the same order.
    prepare_to_measure(ht.job, model, optimizer, dataset, collate)
    cfg = ht.config
    measured = measure_job(ht.job, model, optimizer, default_forward)
    from ..runtime.parallel.blocks import find_parts, repeated_blocks

    try:
        parts = find_parts(model)
    except UsageError:                        # a model no one here wrote: no cuts, but maybe a stack
        parts = None
    measured = _with_blocks(ht, parts, measured)
    measured = _with_fsdp(ht, model, optimizer, measured, default_forward)
    if ht.is_main:
        stack = repeated_blocks(model)
        blocks = len(parts.blocks) if parts is not None else len(stack[1]) if stack else None   # None: --blocks can say
        if parts is None and stack:
            ht.print(f"blocks: {len(stack[1])} {type(stack[1][0]).__name__} in {stack[0]!r} (the model's stack "
                     "of identical blocks), for comparing pipelines")
        write_json_atomic(job["out"], {"config": cfg.to_dict(), "measurements": measured.to_dict(),
                                       "blocks": blocks, "model": model_facts(model, optimizer, blocks, stack=stack)})
    ht.close()


def _with_blocks(ht, parts, measured):
    """The measurements plus the blocks' costs as the runtime sizes a pipeline from them
    (layouts/pipeline_setup.measure_blocks: collective, every rank), when the model's blocks can
    be cut (`parts`: every rank alike, the same model) and there are devices to cut them over."""
    import dataclasses

    from ..runtime.layouts import pipeline_setup

    if ht.world_size < 2 or parts is None:
        return measured
    profile, devices = pipeline_setup.measure_blocks(ht.job, parts)
    ht.print(f"pipeline blocks measured: {profile.source}")
    return dataclasses.replace(measured, pipeline={
        "profile": profile.to_dict(),
        "devices": [{"name": d.name, "speed": d.speed, "memory_bytes": d.memory_bytes} for d in devices]})


def _with_fsdp(ht, model, optimizer, measured, forward):
    """The measurements plus what FSDP2 adds to a step here (runtime/measure/fsdp_probe.py:
    collective, every rank), when there are blocks to shard and devices to shard them over."""
    import dataclasses

    from ..runtime.measure.fsdp_probe import time_fsdp_excess
    from ..runtime.memory.activation_checkpointing import find_blocks

    blocks = [name for name, _ in find_blocks(model, ht.config.memory.blocks)]
    if ht.world_size < 2 or not blocks or not measured.probe_size:
        return measured
    job = ht.job
    batch = job.load(range(min(measured.probe_size, len(job.dataset))))
    found = time_fsdp_excess(model, optimizer, blocks, batch, forward=forward, device=job.device,
                             precision=job.precision.compute,
                             throttle=job.emulated.throttle if job.emulated is not None else None)
    ht.print(f"FSDP2 measured: a step {found['fsdp_s'] * 1e3:.0f} ms against DDP's {found['ddp_s'] * 1e3:.0f} ms "
             f"({found['micro_batch']} samples a rank, median of {found['runs']})")
    return dataclasses.replace(measured, fsdp={**found, "backend": measured.backend})


def model_facts(model, optimizer, blocks, *, stack=False) -> dict:
    """What every layout's memory divides (planning/layouts.ModelState): all parameters, those
    that train, their element sizes, the optimizer, and the parameters outside the blocks.
    `stack`: blocks.repeated_blocks(model) when the caller has it (False: found here)."""
    from ..runtime.memory.device_memory import optimizer_kind
    from ..runtime.parallel.blocks import repeated_blocks

    params = list(model.parameters())
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    stack = repeated_blocks(model) if stack is False else stack
    inside = sum(p.numel() for b in stack[1] for p in b.parameters()) if stack else 0
    return {"params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in train),
            "param_bytes": train[0].element_size() if train else 4,
            "frozen_param_bytes": frozen[0].element_size() if frozen else 4,
            "optimizer": optimizer_kind(optimizer) or "adamw", "blocks": blocks,
            "root_params": sum(p.numel() for p in params) - inside if stack else 0}


if __name__ == "__main__":
    main(sys.argv[1:])
