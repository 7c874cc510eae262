"""The words a job is configured with, defined once: every module that checks or lists them
imports them from here (the lowest layer: it imports nothing of hetrain but its errors)."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import UsageError

PRECISIONS = ("fp32", "bf16", "fp16")                 # what a device computes in
PRECISION_REQUESTS = ("auto",) + PRECISIONS           # what a user may ask for
# Data-parallel sharding of the model state. Ordered as planning prefers them when several fit
# (planning/memory.choose_sharding): least communication first.
AUTO_SHARDINGS = ("none", "zero1", "capacity", "fsdp")   # what DataParallel() (sharding None) chooses from
# capacity-full (parameters, gradients and optimizer state split by free memory: runtime/sharding/
# capacity_full.py) is asked for by name: it turns in-loop OOM recovery off, so auto leaves it out.
SHARDINGS = AUTO_SHARDINGS + ("capacity-full",)
CHECKPOINTINGS = ("plan", "all", "none")              # activation checkpointing: where the plan says | all | none
LOSS_WEIGHTINGS = ("samples", "tokens")
RESUME_MODES = ("auto", "must", "never")
SCHEDULES = ("gpipe", "1f1b")                         # pipeline schedules (torch.distributed.pipelining)
LAYOUTS = ("dp", "pp", "dp-pp", "tp")                 # how a model is spread over the devices (runtime/layouts/)
PARALLEL_REQUESTS = ("auto",) + LAYOUTS               # what prepare(parallel=) takes (or a Plan)
TP_SPLITS = ("even", "speed")                         # tensor parallelism: heads and MLP columns per rank
# Gradient compression of DDP's all-reduce, through torch's own DDP communication hooks
# (runtime/sharding/comm_hooks.py; planned by planning/compression.py). 'auto': fp16 (bf16 on
# NCCL) when the job spans nodes and the plan predicts a gain of 5% or more; never PowerSGD.
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
COMPRESSION_REQUESTS = ("auto",) + COMPRESSIONS


def check_choice(value: object, allowed: Sequence[str], where: str) -> str:
    """`value` when it is one of `allowed`; else a one-line UsageError that lists them."""
    if value not in allowed:
        raise UsageError(f"{where} {value!r} is not one of {', '.join(allowed)}")
    return value  # type: ignore[return-value]
