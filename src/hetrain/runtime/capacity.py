"""This rank's device, measured before training, and the Plan all ranks agree on from it."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..hardware.units import format_bytes
from ..planning.plan import Plan
from ..planning.shares import DeviceCapacity, static_plan
from .probe import probe, time_sizes


def measure_capacity(engine, model, forward) -> DeviceCapacity:
    """This rank's speed, time model and largest micro-batch, with the reason for each."""
    cfg, emu = engine.config, engine.emulated
    equal = max(1, cfg.global_batch // engine.world_size)
    cap = None
    if emu is not None:
        cap = emu.meter.cap
    elif engine.device.type == "cuda":
        cap = torch.cuda.get_device_properties(engine.device).total_memory

    max_micro, micro_reason = None, "memory not capped"
    if cap is not None:
        n = min(equal, 4)
        per_sample = max(probe(model, engine._load(range(n)), samples=n, forward=forward,
                               device=engine.device).activation_bytes_per_sample, 1.0)
        fixed = emu.meter.fixed if emu is not None else torch.cuda.memory_allocated(engine.device)
        usable = cap * (1 - cfg.memory_margin) - fixed
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

    per_sample_s = fixed_s = None
    if engine.world_size > 1:   # the split needs each device's time model
        hi = min(equal, max_micro or equal)
        lo = max(1, hi // 4)
        timing = time_sizes(model, {m: engine._load(range(m)) for m in {lo, hi}}, forward=forward,
                            device=engine.device)
        slow = emu.spec.speed if emu is not None else 1.0   # the CPU's time, stretched as emulated
        per_sample_s, fixed_s = timing.per_sample_s / slow, timing.fixed_s / slow
    if emu is not None:
        speed, speed_reason = emu.spec.speed, f"{emu.spec.speed_source}, emulated"
    elif per_sample_s is not None:
        speed = equal / (fixed_s + equal * per_sample_s)
        speed_reason = f"measured {speed:.1f} samples/s at {equal} samples"
    else:
        speed, speed_reason = 1.0, "single device"
    return DeviceCapacity(device=engine.device_label, speed=speed, speed_reason=speed_reason,
                          max_micro_batch=max_micro, micro_reason=micro_reason, memory_cap_bytes=cap,
                          precision=cfg.precision, per_sample_s=per_sample_s, fixed_s=fixed_s)


def agree_plan(engine, mine: DeviceCapacity) -> Plan:
    """Every rank's capacity, gathered; every rank then computes the same Plan from them.

    Emulated devices all run on the same kind of CPU thread, so their measured time models differ
    only by noise and by the emulated speed: the mean model, stretched by each device's speed,
    gives every run the same split instead of one that wobbles with the noise."""
    capacities = [mine]
    if engine.world_size > 1:
        capacities = [None] * engine.world_size
        dist.all_gather_object(capacities, mine)
    if engine.emulated is not None and all(c.per_sample_s is not None for c in capacities):
        per_sample = sum(c.per_sample_s * c.speed for c in capacities) / len(capacities)
        fixed = sum(c.fixed_s * c.speed for c in capacities) / len(capacities)
        capacities = [replace(c, per_sample_s=per_sample / c.speed, fixed_s=fixed / c.speed)
                      for c in capacities]
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
    if plan.note:
        log.info(f"  plan v{plan.version}: {plan.note}")
    for d in plan.devices:
        for reason in d.reasons:
            log.info(f"  rank {d.rank}: {reason}")
