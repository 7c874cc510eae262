"""Sizing a pipeline before it is built (runtime/layouts/pipeline/setup.py): every rank's speed
and memory (`device_table`), the block costs agreed by all ranks, the split by the planner
(runtime/layouts/pipeline/split.py), and what is shown and warned about it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ....errors import UsageError
from ....hardware.units import format_bytes
from .split import (BlockCost, PipelineProfile, PipelineSplit, StageDevice,
                                       evaluate_split, split_pipeline)
from ....planning.plan import split_evenly
from ...devices.cuda_memory import usable_bytes
from ...ranks import agree
from .blocks import PipelineParts, profile_blocks

def device_table(ht) -> list[StageDevice]:
    """Every rank's device (speed, memory), agreed: as the device's spec gives them, or CUDA
    memory and catalog speed (replaced by measured speeds when the blocks are profiled)."""
    speed, memory = 1.0, 0.0
    given = ht.hooks.given_device()
    if given is not None:
        speed, memory = given
    elif ht.device.type == "cuda":
        from ....hardware import catalog

        gpu = catalog.lookup(torch.cuda.get_device_name(ht.device))
        speed = gpu.speed_index if gpu is not None else 1.0
        memory = float(usable_bytes(ht.device))
    table = agree.exchange({"speed": speed, "memory": memory}, rank=ht.rank, world_size=ht.world_size,
                           device=ht.device)
    # Given speeds are kept as they are (DeviceHooks.given_device); real GPUs: rank 0's device is
    # measured, so speeds are relative to the fastest.
    fastest = max(table.column("speed")) if given is None else 1.0
    labels = [None] * ht.world_size
    dist.all_gather_object(labels, ht.device_label)
    return [StageDevice(name=labels[r], speed=table.row(r)["speed"] / fastest,
                        memory_bytes=table.row(r)["memory"] or None) for r in range(ht.world_size)]


def agreed_profile(ht, parts: PipelineParts, example: torch.Tensor | None,
                   devices: list[StageDevice]) -> tuple[PipelineProfile, list[StageDevice]]:
    """The block costs every rank sizes the split from (rank 0's, at speed 1.0), and the devices.

    On CPUs (devices given by a spec among them): rank 0's CPU time is the speed-1.0 time and the
    speeds are the device table's, under rank 0's autocast (a mixed bf16/fp16 cluster is costed at rank 0's precision). Real GPUs: every
    rank measures the blocks on its own device, under its own autocast, and a device's speed is the
    fastest total time over its own (measured, not the catalog's guess)."""
    if example is None:
        raise UsageError("sizing a pipeline needs a micro-batch of inputs to time the blocks",
                         "give the dataset (inputs, targets) samples")
    measure_all = ht.device.type == "cuda"      # (a device given by a spec runs on the CPU)
    mine = (profile_blocks(parts, example, device=ht.device, precision=ht.precision)
            if (measure_all or ht.rank == 0) else None)
    if measure_all:
        totals = agree.exchange({"seconds": mine.seconds_per_sample}, rank=ht.rank, world_size=ht.world_size,
                                device=ht.device).column("seconds")
        devices = [StageDevice(name=d.name, speed=min(totals) / t, memory_bytes=d.memory_bytes)
                   for d, t in zip(devices, totals)]
        if ht.rank == 0:     # rank 0's times, scaled to the fastest device
            mine = _scaled(mine, devices[0].speed)
    box = [mine if ht.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0], devices


def _scaled(profile: PipelineProfile, speed: float) -> PipelineProfile:
    def scale(c: BlockCost | None) -> BlockCost | None:
        return None if c is None else dataclasses.replace(c, seconds=c.seconds * speed)

    return dataclasses.replace(profile, blocks=tuple(scale(b) for b in profile.blocks), first=scale(profile.first),
                               last=scale(profile.last), source=profile.source + f", scaled to speed 1.0 by {speed:.3g}")


def plan_split(profile: PipelineProfile, devices: Sequence[StageDevice], split, **kwargs) -> PipelineSplit:
    """`split`: None (sized by speed and memory), 'uniform', or blocks per stage."""
    if split is None:
        return split_pipeline(profile, devices, **kwargs)
    if split == "uniform":   # (more stages than blocks: evaluate_split says so)
        n, p = profile.n_blocks, len(devices)
        split = split_evenly(n, p) if p <= n else (1,) * p
    if isinstance(split, str):
        raise UsageError(f"split={split!r}", "use None (by speed and memory), 'uniform', or blocks per stage")
    return evaluate_split(profile, devices, split, **kwargs)


NOT_MEASURED = "not measured (split given without example=)"


def unmeasured_profile(parts: PipelineParts) -> PipelineProfile:
    """Equal unit costs: a given split still gets replica shares by device speed."""
    return PipelineProfile(blocks=tuple(BlockCost(seconds=1.0, name=f"block {i}") for i in range(len(parts.blocks))),
                           source=NOT_MEASURED)


def param_names(model) -> dict[int, str]:
    names: dict[int, str] = {}
    if isinstance(model, nn.Module):
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)      # a tied weight keeps its first name (GPT: tok.weight)
    return names


def warn_if_over(ht, splits: Sequence[PipelineSplit]) -> None:
    """A split the user gave that the measured costs say will not fit: say so before running it."""
    for r, sp in enumerate(splits):
        for st in sp.stages:
            if not st.fits:
                ht.log.warn_job(f"split {'/'.join(map(str, sp.sizes))}: stage {st.index}"
                            + (f" of replica {r}" if len(splits) > 1 else "")
                            + f" ({st.device}) is predicted to need {format_bytes(st.memory_bytes)}, "
                            f"{format_bytes(st.memory_cap)} usable; leave split=None to size stages by memory, "
                            "or use 1f1b, smaller micro-batches or activation checkpointing")


def show(ht, title: str, splits: Sequence[PipelineSplit], reasons: Sequence[str], *, measured: bool) -> None:
    """The split as a table on rank 0: one row per stage (per replica under DP×PP)."""
    rows = []
    for r, sp in enumerate(splits):
        for s in sp.stages:
            cost = (f"{s.seconds_per_micro * 1e3:.3g}", format_bytes(s.memory_bytes)) if measured else ("-", "-")
            rows.append(((f"{r}/" if len(splits) > 1 else "") + str(s.index), s.device, f"{s.speed:.3g}",
                         f"{s.start}-{s.stop - 1}", s.in_flight, *cost))
    ht.log.table(title + f", bubble {splits[0].bubble_fraction:.0%}",
                 ("replica/stage" if len(splits) > 1 else "stage", "device", "speed", "blocks",
                  "in flight", "ms/micro", "memory"), rows)
    for reason in reasons:
        ht.log.info(f"  {reason}")
