"""The model the user gets back from prepare(): their module, run through DDP.

Forward goes through the DistributedDataParallel wrapper (which must see every forward to sync
the right backward) and, where the device hooks meter memory, through their meter. state_dict and
attribute access go to the user's own module, so checkpoints have the user's keys. close() swaps
the DDP wrapper out, so it is freed before the process group is destroyed (gloo's exit abort).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class PreparedModel(nn.Module):
    def __init__(self, module: nn.Module, forward_module: nn.Module, meter=None):
        super().__init__()
        self._forward_module = forward_module
        object.__setattr__(self, "_hetrain_module", module)   # not registered twice
        object.__setattr__(self, "_hetrain_meter", meter)

    @property
    def module(self) -> nn.Module:
        """The user's own model."""
        return self._hetrain_module

    def forward(self, *args, **kwargs):
        meter = self._hetrain_meter
        if meter is not None and torch.is_grad_enabled():
            with meter.forward(_signature(args, kwargs, self._hetrain_module.training)):
                return self._forward_module(*args, **kwargs)
        return self._forward_module(*args, **kwargs)

    def release_wrapper(self) -> None:
        """Drop the DDP wrapper; forward then calls the user's module directly."""
        self._forward_module = self._hetrain_module

    def state_dict(self, *args, **kwargs):
        return self._hetrain_module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._hetrain_module.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._hetrain_module, name)


class _Unknown(Exception):
    """An input the signature cannot describe: the forward is counted, not looked up."""


def _signature(args, kwargs, training: bool) -> tuple | None:
    """What decides the bytes a forward saves, for a memory meter of the device hooks (MemoryMeter):
    every tensor input's shape and dtype (in nested sequences and mappings too), plain values,
    train/eval mode and the autocast modes. None (always counted) for an input of any other kind:
    a batch object whose sizes the signature cannot see must not share one entry."""
    def walk(x):
        if isinstance(x, torch.Tensor):
            if x.is_nested:
                raise _Unknown
            return (tuple(x.shape), x.dtype, x.requires_grad)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, *map(walk, x))
        if isinstance(x, Mapping):
            return (type(x).__name__, *((k, walk(v)) for k, v in x.items()))
        if isinstance(x, (bool, int, str, type(None))) or (isinstance(x, float) and x == x):
            return x
        raise _Unknown
    try:
        return (walk(args), walk(kwargs), training, torch.is_autocast_enabled("cpu"),
                torch.is_autocast_enabled("cuda"))
    except _Unknown:
        return None
