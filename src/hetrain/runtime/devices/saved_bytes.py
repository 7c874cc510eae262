"""What a device holds, counted from the tensors themselves where no allocator counts it (a CPU):
the model state (parameters, gradients, optimizer state, as this rank holds them) and the bytes a
forward saves for its backward. The profiler and the probes count a CPU's memory with these; a
device whose hooks keep a memory meter counts through them too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import contextmanager

import torch


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's (FSDP2, TP) local shard, else the tensor.
    No DTensor exists before torch.distributed.tensor is imported, so it is looked up, not
    imported only to ask."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages under `tensors`, each storage once (this rank's shards only)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = local_part(t).untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer state this rank holds. Sharded optimizers hold only their part:
    ZeroRedundancyOptimizer keeps it in its local `.optim`; hetrain's capacity sharding lists
    what it holds in `held_tensors()`."""
    held = getattr(optimizer, "held_tensors", None)
    if callable(held):
        return [local_part(t) for t in held()]
    local = getattr(optimizer, "optim", optimizer)
    state = []
    for s in local.state.values():
        state += [local_part(v) for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return state


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters + gradients (one per trainable parameter) + optimizer state, as held now
    (this rank's shards only, under ZeRO/FSDP2)."""
    params = list(model.parameters())
    local = [local_part(p) for p in params]
    grads = sum(t.numel() * t.element_size() for p, t in zip(params, local) if p.requires_grad)
    state = optimizer_state_tensors(optimizer) if optimizer is not None else []
    return tensor_bytes(local) + tensor_bytes(model.buffers()) + grads + tensor_bytes(state)


class SavedBytes:
    """Counts the bytes a forward saves for its backward: every storage a saved tensor sits on,
    once, the model's parameters left out (they are model state, not activations)."""

    def __init__(self, model: torch.nn.Module):
        self._skip = {local_part(p).untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.activations = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local_part(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.activations += storage.nbytes()
        return t

    @contextmanager
    def forward(self):
        """Count one forward's saved tensors (afresh: `activations` is this forward's)."""
        self._seen.clear()
        self.activations = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
