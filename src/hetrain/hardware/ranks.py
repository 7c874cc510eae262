"""Under torchrun (`torchrun --nnodes 2 --nproc-per-node N -m hetrain doctor`): every rank's
versions, gathered to all ranks, so the doctor can say whether NCCL, torch, CUDA and the driver
match across ranks and nodes (NCCL refuses to connect mismatched versions, nccl#1267).

Uses a gloo group (CPU, no GPU needed) joined from torchrun's environment variables, or the
caller's group when one exists.
"""

from __future__ import annotations

import datetime
import os

FIELDS = ("torch", "torch_cuda", "nccl", "driver", "cudnn")


def under_torchrun(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in environ
    except ValueError:
        return False


def rank_versions(facts: dict) -> dict:
    """What must match across ranks, plus where the rank runs (for side-by-side messages)."""
    v = facts.get("versions", {})
    return {**{k: v.get(k) for k in FIELDS}, "hostname": facts.get("host", {}).get("hostname"),
            "gpus": [g.get("name") for g in facts.get("gpus", ())]}


def gather_rank_versions(facts: dict, *, timeout_s: float = 120.0) -> tuple[dict, ...] | None:
    """Every rank's `rank_versions`, in rank order, on every rank; None when not under torchrun.
    All ranks must call it (it is one collective)."""
    import torch.distributed as dist

    if not dist.is_initialized() and not under_torchrun():
        return None
    made = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        made = True
    try:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, rank_versions(facts))
        return tuple(out)
    finally:
        if made:
            dist.destroy_process_group()
