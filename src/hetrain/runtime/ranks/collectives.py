"""The device a collective's tensors must be on.

A CUDA job's group is NCCL only (runtime/ranks/dist.py; why no CPU route: docs/architecture.md,
"Collectives and devices"): it takes CUDA tensors on the rank's device and raises on a CPU one. So
a tensor made for a collective is made on the job's device, never by default (the CPU) nor beside
host-side state (an offloaded optimizer's). Code that holds the job's device (`job.device`, the
sharding's `device`) uses it; code that only holds the group asks here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The device `group`'s collectives take tensors on (the default group when None): the
    current CUDA device under NCCL, the CPU otherwise (gloo)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
