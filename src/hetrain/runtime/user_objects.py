"""What hetrain reads off the user's objects, at the bottom of runtime's layers so that every
subpackage may use it: the model's repeated blocks, how to call the model on a batch, its output
as one number, the optimizer's kind for the planner, a batch moved to a device."""

from __future__ import annotations

import torch
from torch import nn


def find_blocks(model: nn.Module, block_type: str | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks to checkpoint, in model order."""
    if block_type is not None:
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ == block_type and m is not model]
    found, inside = [], set()
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue   # a list inside a block we already take: the outer block is the unit
        if isinstance(m, nn.ModuleList):
            for i, child in enumerate(m):
                found.append((f"{name}.{i}" if name else str(i), child))
                inside.add(f"{name}.{i}" if name else str(i))
    return found


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


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """The planning model's name for a torch optimizer, subclasses included (None: unknown)."""
    d, o = optimizer.defaults, torch.optim
    if isinstance(optimizer, o.SGD):
        return "sgd-momentum" if d.get("momentum", 0) else "sgd"
    if isinstance(optimizer, (o.Adam, o.AdamW)):
        base = "adamw" if isinstance(optimizer, o.AdamW) else "adam"
        return base + ("-amsgrad" if d.get("amsgrad") else "")
    if isinstance(optimizer, o.RMSprop):
        return "rmsprop-momentum" if d.get("momentum", 0) else "rmsprop"
    for cls, name in ((o.Adagrad, "adagrad"), (o.Adamax, "adamax"), (o.NAdam, "nadam"), (o.RAdam, "radam"),
                      (o.Adadelta, "adadelta")):
        if isinstance(optimizer, cls):
            return name
    return None


def to_device(obj, device: torch.device):
    """A batch (tensor, or tuple/list/dict of them, nested) moved to `device`; other values as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
