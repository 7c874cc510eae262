"""What `hetrain plan`, `simulate` and `bench` share on their command lines: numbers with units,
the model (a preset, LoRA on a preset, or given sizes) and the link; each bad value is one
line naming the fix."""

from __future__ import annotations

import math
from typing import Optional

from ..errors import UsageError
from ..hardware.units import parse_bytes
from ..planning.collectives import Link
from ..planning.presets import PRESETS, fine_tuned
from ..planning.profile import ModelSpec
from ..vocabulary import PRECISIONS, check_choice


def number(text: str, what: str, *, integer: bool = False, allow_units: bool = False) -> float:
    """'124e6', '1.2e12', '600MiB' (with allow_units) -> a positive number; else a UsageError."""
    try:
        value = float(text)
    except ValueError:
        if allow_units:
            return float(parse_bytes(text, what=what))
        raise UsageError(f"{what} {text!r} is not a number", f"give a positive number, e.g. {what} 1.2e9") from None
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{what} {text!r} must be a positive number", f"give a positive number for {what}")
    if integer and value != int(value):
        raise UsageError(f"{what} {text!r} must be a whole number", f"give a whole number for {what}")
    return int(value) if integer else value


def positive_int(value: int, what: str, fix: str) -> int:
    if value < 1:
        raise UsageError(f"{what} {value} must be at least 1", fix)
    return value


def check_common(global_batch: int, precision: str, memory_margin: float, *, precisions=PRECISIONS) -> None:
    positive_int(global_batch, "--global-batch", "give the samples per optimizer step, e.g. --global-batch 256")
    check_choice(precision, precisions, "--precision")
    if not 0 <= memory_margin < 1:
        raise UsageError(f"--memory-margin {memory_margin}", "give the fraction of memory kept free, in [0, 1)")


def model_spec(model: Optional[str], params: Optional[str], flops: Optional[str], act: Optional[str],
                trainable: Optional[str] = None, lora: Optional[int] = None) -> ModelSpec:
    if model and any(v is not None for v in (params, flops, act)):
        raise UsageError("--model and --params/--flops-per-sample/--activation-bytes both given",
                         "give a preset with --model, or the three numbers, not both")
    n_trainable = None if trainable is None else int(number(trainable, "--trainable-params", integer=True))
    if model:
        return fine_tuned(model, trainable=n_trainable, lora_rank=lora)
    if lora is not None:
        raise UsageError(f"--lora {lora} needs a model preset (it sizes the adapters from the preset's layers)",
                         "for a model given by --params, give its trainable parameters with --trainable-params N "
                         "(LoRA of rank r adds r·(in+out) per adapted in→out linear)")
    if params is None:
        raise UsageError("no model given",
                         f"give --model PRESET ({', '.join(PRESETS)}) or --params, --flops-per-sample "
                         "and --activation-bytes")
    n = int(number(params, "--params", integer=True))
    if flops is None or act is None:
        missing = " and ".join(f for f, v in (("--flops-per-sample", flops), ("--activation-bytes", act)) if v is None)
        raise UsageError(f"--params given without {missing}",
                         "give all three, e.g. --params 124e6 --flops-per-sample 8.8e11 --activation-bytes 600MiB "
                         "(a transformer's FLOPs per sample ≈ 6 · params · tokens)")
    if n_trainable is not None and n_trainable > n:
        raise UsageError(f"--trainable-params {trainable} is more than --params {params}",
                         "give at most the model's parameters (all of them train: leave --trainable-params out)")
    return ModelSpec(name=f"{n / 1e6:.4g}M-parameter model", params=n, trainable_params=n_trainable,
                     flops_per_sample=number(flops, "--flops-per-sample"),
                     activation_bytes_per_sample=number(act, "--activation-bytes", allow_units=True),
                     assumptions="given on the command line" + (
                         f"; fine-tuning {n_trainable:,} trainable parameters, the frozen rest at the "
                         "training precision" if n_trainable is not None else ""))


def link_option(link_gbs: Optional[float]) -> Link | None:
    if link_gbs is None:
        return None
    if not link_gbs > 0:
        raise UsageError(f"--link-gbs {link_gbs} must be positive", "give the slowest link's bandwidth in GB/s, e.g. 24")
    return Link(bandwidth_gbs=link_gbs, source="given with --link-gbs")


def saver_options(offload: str, host_memory: Optional[str], checkpointing: str, *, nodes: int = 1,
                  default_host: float | None = None) -> dict:
    """PlanOptions' memory-saver fields from --offload, --host-memory and --checkpointing:
    --host-memory is per node (the devices' nodes share no host memory, so it is counted once
    per node); without it `default_host` per node (None: not known, no offload)."""
    from ..planning.options import OFFLOADS
    from ..vocabulary import CHECKPOINTINGS

    if offload not in OFFLOADS:
        raise UsageError(f"--offload {offload!r} is not one of {', '.join(OFFLOADS)}",
                         "plan: where needed to fit, smallest cards first; all: every device; none: never")
    check_choice(checkpointing, CHECKPOINTINGS, "--checkpointing")
    per_node = float(parse_bytes(host_memory, what="--host-memory")) if host_memory is not None else default_host
    return {"offload": offload, "host_memory_bytes": None if per_node is None else per_node * max(nodes, 1),
            "allow_checkpointing": checkpointing != "none"}


def check_offload_request(state, options) -> None:
    """--offload all with no host room for it, even fully sharded: one line with the fix."""
    from ..hardware.units import format_bytes
    from ..planning.savers import host_room

    if options.offload != "all":
        return
    need = state.state("fsdp", world_size=1, offload=True).host      # the least any layout puts there
    room = host_room(options)
    if need > room:
        raise UsageError(f"--offload all: the optimizer state needs {format_bytes(need)} of host memory at the "
                         f"least (fully sharded), {format_bytes(room)} usable",
                         "give the host's memory with --host-memory (per node), or --offload plan")
