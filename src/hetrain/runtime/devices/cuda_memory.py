"""What a CUDA device has for this process: the one place capacity is read.

The card's total (`get_device_properties`) is not what a job can use: the CUDA context
(0.3-1 GiB), NCCL's buffers and other processes on the card hold part of it. What this process can
hold is the driver's free memory (`mem_get_info`) plus what its own caching allocator already
reserves (its tensors, the model among them, and its cache): the planner's figures include the
model state that is already there.
"""

from __future__ import annotations

import torch


def usable_bytes(device: torch.device) -> int:
    """Bytes this process can hold on a CUDA `device`: free memory plus its allocator's reserve."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))
