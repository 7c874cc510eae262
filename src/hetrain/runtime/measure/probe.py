"""How hetrain calls a model it knows nothing about, when it measures it before training
(runtime/measure/profiler.py, runtime/memory/device_memory.py): the forward, and a scalar to backpropagate."""

from __future__ import annotations

import torch


def default_forward(model, batch):
    """How hetrain calls a model on a batch it knows nothing about: model(x) for (x, y) batches,
    model(**batch) for dicts, model(batch) otherwise. Pass prepare(forward=...) to change it."""
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def as_scalar(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return sum(as_scalar(o) for o in out if isinstance(o, (torch.Tensor, tuple, list, dict)))
    raise TypeError(f"cannot reduce a model output of type {type(out).__name__} to a scalar; "
                    "pass prepare(forward=...) that returns a tensor")
