"""This rank's device, measured before training, and the Plan all ranks agree on from it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..hardware.units import format_bytes
from ..planning.plan import Plan
from ..planning.shares import DeviceCapacity, static_plan
from .probe import probe


def measure_capacity(engine, model, forward) -> DeviceCapacity:
    """This rank's speed and largest micro-batch, with the reason for each."""
    cfg, emu = engine.config, engine.emulated
    equal = max(1, cfg.global_batch // engine.world_size)
    cap = None
    if emu is not None:
        cap = emu.meter.cap
    elif engine.device.type == "cuda":
        cap = torch.cuda.get_device_properties(engine.device).total_memory
    need_timing = emu is None and engine.world_size > 1
    result = None
    if cap is not None or need_timing:
        n = min(equal, 4)
        batch = engine._load(range(n))
        result = probe(model, batch, samples=n, forward=forward, device=engine.device,
                       timed_runs=2 if need_timing else 0)

    if emu is not None:
        speed, speed_reason = emu.spec.speed, f"{emu.spec.speed_source}, emulated"
    elif need_timing:
        speed = 1.0 / result.seconds_per_sample
        speed_reason = f"measured {speed:.1f} samples/s in a warm-up"
    else:
        speed, speed_reason = 1.0, "single device"

    max_micro, micro_reason = None, "memory not capped"
    if cap is not None:
        fixed = emu.meter.fixed if emu is not None else torch.cuda.memory_allocated(engine.device)
        usable = cap * (1 - cfg.memory_margin) - fixed
        per_sample = max(result.activation_bytes_per_sample, 1.0)
        max_micro = int(usable // per_sample)
        micro_reason = (f"{format_bytes(cap)} memory, {format_bytes(fixed)} model state, "
                        f"measured {format_bytes(per_sample)}/sample, {cfg.memory_margin:.0%} kept free")
        if max_micro < 1:
            raise UsageError(
                f"{engine.device_label}: one sample needs {format_bytes(per_sample)} of activations "
                f"but only {format_bytes(max(usable, 0))} is free after the model state",
                "use a device with more memory, a smaller model or sequence, or activation checkpointing",
            )
    if cfg.micro_batch is not None and (max_micro is None or cfg.micro_batch < max_micro):
        max_micro, micro_reason = cfg.micro_batch, "micro_batch set in the config"
    return DeviceCapacity(device=engine.device_label, speed=speed, speed_reason=speed_reason,
                          max_micro_batch=max_micro, micro_reason=micro_reason,
                          memory_cap_bytes=cap, precision=cfg.precision)


def agree_plan(engine, mine: DeviceCapacity) -> Plan:
    """Every rank's capacity, gathered; every rank then computes the same Plan from them."""
    capacities = [mine]
    if engine.world_size > 1:
        capacities = [None] * engine.world_size
        dist.all_gather_object(capacities, mine)
    return static_plan(engine.config.global_batch, capacities)


def check_given_plan(engine, plan: Plan) -> Plan:
    if plan.world_size != engine.world_size or plan.global_batch != engine.config.global_batch:
        raise UsageError(
            f"the given plan is for {plan.world_size} device(s) and global batch {plan.global_batch}, "
            f"this job has {engine.world_size} and {engine.config.global_batch}",
            "make a plan for this job (`hetrain plan`), or drop the plan to let hetrain split",
        )
    return plan


def show_plan(log, plan: Plan, total_steps: int) -> None:
    rows = []
    for d in plan.devices:
        sizes = d.micro_sizes()
        micro = f"{sizes[0]}" + (f" x{len(sizes)}" if len(sizes) > 1 else "")
        rows.append((d.rank, d.device, f"{d.speed:.3g}", d.share, micro, d.precision))
    log.table(f"plan v{plan.version}: global batch {plan.global_batch} over {plan.world_size} device(s), "
              f"{total_steps} steps", ("rank", "device", "speed", "share", "micro-batch", "precision"), rows)
    for d in plan.devices:
        for reason in d.reasons:
            log.info(f"  rank {d.rank}: {reason}")
