"""What hetrain reads off the user's objects, at the bottom of runtime's layers so that every
subpackage may use it: the model's repeated blocks, how to call the model on a batch, its output
as one number, the optimizer's kind for the planner, and batches: moved to a device, counted,
cut into parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import HetrainError, UsageError


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


class ForwardCallError(UsageError):
    """hetrain called the model on a batch its own way (default_forward) and the call failed."""


def default_forward(model, batch):
    """How hetrain calls a model on a batch it knows nothing about, as the tools do: model(**batch)
    for a mapping (dict, a tokenizer's BatchEncoding and other UserDicts), model(x) for an (x, y)
    tuple or list, model(batch) otherwise (a tensor, a dataclass). The one place hetrain calls the
    user's model for its own measurements. A call that fails for its form (a TypeError,
    AttributeError, KeyError, IndexError or ValueError, not an error of hetrain's nor out of memory)
    is a ForwardCallError naming the form and the fix: forward=."""
    if isinstance(batch, Mapping):
        how, call = "model(**batch)", lambda: model(**batch)
    elif isinstance(batch, (tuple, list)):
        how, call = "model(batch[0])", lambda: model(batch[0])
    else:
        how, call = "model(batch)", lambda: model(batch)
    try:
        return call()
    except HetrainError:
        raise
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        raise ForwardCallError(
            f"hetrain called the model as {how} on a {type(batch).__name__} batch to measure it, and it raised "
            f"{type(e).__name__}: {str(e) or '(no message)'}",
            "pass forward=lambda model, batch: ... that calls the model on a batch as your loop does "
            "(ht.prepare(forward=...), or the integration's forward=)") from e


def as_scalar(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return sum(as_scalar(o) for o in out if isinstance(o, (torch.Tensor, tuple, list, Mapping)))
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


# -- batches: moved, counted and cut as Accelerate's send_to_device / find_batch_size / slice_tensors
# do (tensors in nested tuples, lists, namedtuples and mappings, a mapping's own type kept), and
# dataclasses too, field by field. torch has no public walker that keeps UserDicts and dataclasses.
def _rebuild(obj, fn):
    """`obj` with fn applied to every tensor in it, its containers of the same types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [_rebuild(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping):
        items = {k: _rebuild(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:          # a mapping type not made from a dict
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _rebuild(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def to_device(obj, device: torch.device):
    """A batch moved to `device`: its tensors, in any of the containers above; an object with its
    own `.to` (a BatchEncoding) moves itself, as Accelerate's send_to_device does; other values as
    they are."""
    if not isinstance(obj, (torch.Tensor, nn.Module)) and callable(getattr(obj, "to", None)):
        try:
            return obj.to(device, non_blocking=True)
        except TypeError:          # a .to without non_blocking
            return obj.to(device)
    return _rebuild(obj, lambda t: t.to(device, non_blocking=True))


def rows(batch) -> int | None:
    """The batch's samples: the leading size of its first tensor (depth first), None without one."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = list(batch)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        return None
    return next((n for n in map(rows, values) if n is not None), None)
