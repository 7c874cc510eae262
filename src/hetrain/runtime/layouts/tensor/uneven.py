"""Tensor parallelism with each rank's part of every layer in proportion to its speed.

    model = tensor_parallel(model, speeds=[1.0, 0.6])   # layouts/tensor/shard.py: 8 heads -> 5 / 3

The same Megatron pairs as the even split (layouts/tensor/styles.py finds them; hf.py for
Hugging Face models), cut unevenly:
  * attention: the unit is one key/value group (one key/value head and the query heads that
    share it). A rank takes whole, contiguous groups: q rows [u0·g·d, u1·g·d), k and v rows
    [u0·d, u1·d), the output projection's input columns as q's (d: head width, g: query heads per
    key/value head). Each rank keeps g query heads per key/value head, so grouped-query attention
    runs on its own heads unchanged; without GQA a group is one head (8 heads over 1 : 0.6 -> 5/3).
  * MLP: the unit is one hidden column: the up/gate rows and the down projection's columns.
  * How many units: `planning.shares.proportional_shares(units, speeds)`, the share solver's
    integers (each >= 1, minimising max(units / speed)): the same rounding as the batch shares.

Why not DTensor: DTensor's Shard(d) places shard r at torch.chunk's offsets. `DTensor.from_local(
..., shape=, stride=)` accepts uneven local tensors, but redistribute and full_tensor still pad each
one to the chunk size before the all-gather (Shard._to_replicate_tensor), so a 5 / 3 split of 8
rows fails there (gloo: "Received data size doesn't match expected size"), and sharding
propagation assumes chunk-sized shards too. So the shards here are plain tensors, with Megatron's
two collectives as autograd functions on torch.distributed.all_reduce:
  * into a column-parallel Linear: identity forward, all-reduce of the input's gradient backward
    (each rank's gradient is its heads' part of the whole one);
  * out of a row-parallel Linear: all-reduce of the partial sums forward, identity backward (the
    output is replicated, so every rank already holds the whole gradient). Not
    torch.distributed.nn.functional.all_reduce: its backward all-reduces the gradient again, which
    would multiply it by the group size here (and it is deprecated in torch 2.13).
The all-reduce of two (or more) ranks' partial sums gives every rank the same bits, so replicated
parts stay equal on every rank, and the bias of a row-parallel Linear is added once, after it.

Checks first: every count is read from the model's structure and the speeds, so a split that
cannot give every rank a whole unit raises the same UsageError on every rank before any collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ....errors import UsageError
from ....planning.shares import proportional_shares
from .styles import Split


class _CopyToShards(torch.autograd.Function):
    """Megatron's f: identity forward; the input gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumShards(torch.autograd.Function):
    """Megatron's g: the partial outputs summed over the group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ShardedLinear(nn.Linear):
    """This rank's rows (`dim` 0: column parallel) or input columns (`dim` 1: row parallel)
    [start, stop) of a Linear, with the Linear's parameter names, so the model's names hold."""

    def __init__(self, linear: nn.Linear, *, dim: int, start: int, stop: int, group=None):
        nn.Module.__init__(self)        # not Linear's: it would allocate (and initialise) a whole weight
        w = linear.weight.detach()
        local = w[start:stop] if dim == 0 else w[:, start:stop]
        self.weight = nn.Parameter(local.clone(), requires_grad=linear.weight.requires_grad)
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:   # a row-parallel bias is the whole one, added once after the sum
            b = linear.bias.detach()
            self.bias = nn.Parameter((b[start:stop] if dim == 0 else b).clone(),
                                     requires_grad=linear.bias.requires_grad)
        self.out_features, self.in_features = self.weight.shape
        self.dim, self.start, self.stop, self.full = dim, start, stop, w.shape[dim]
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == 0:
            return F.linear(_CopyToShards.apply(x, self.group), self.weight, self.bias)
        out = _SumShards.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias

    def sharded(self) -> list[nn.Parameter]:
        """The parameters that hold only this rank's part (a row-parallel bias is whole)."""
        return [self.weight] + ([self.bias] if self.dim == 0 and self.bias is not None else [])

    def extra_repr(self) -> str:
        kind = "rows" if self.dim == 0 else "input columns"
        return f"{super().extra_repr()}, {kind} [{self.start}, {self.stop}) of {self.full}"


def units(split: Split) -> tuple[str, int]:
    """What a split is cut into: ('key/value heads', n) for attention, ('MLP columns', h)."""
    counts = dict(split.counts)
    if split.kind == "attention":
        return "key/value heads", counts["key/value heads"]
    return "MLP columns", counts["MLP width"]


def check_speeds(speeds, size: int) -> tuple[float, ...]:
    if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence) or len(speeds) != size:
        raise UsageError(f"speeds= takes one relative speed per rank of the tensor-parallel group ({size}), "
                         f"got {speeds!r}", f"pass {size} positive numbers, e.g. speeds=[1.0, 0.6]")
    out = []
    for s in speeds:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (s > 0 and math.isfinite(s)):
            raise UsageError(f"speeds={list(speeds)!r}: every speed must be a positive finite number",
                             "pass each rank's relative speed, e.g. speeds=[1.0, 0.6]")
        out.append(float(s))
    return tuple(out)


def speed_split(splits: list[Split], speeds: Sequence[float]) -> list[tuple[int, ...]]:
    """Every split's units per rank, in proportion to `speeds`, or one UsageError (the first
    split that cannot give every rank a whole unit) naming the fix."""
    size = len(speeds)
    out = []
    for s in splits:
        n = units(s)[1]
        if n < size:
            where = f"block {s.block!r}" + ("" if s.module == s.block else f" ({s.module})")
            counts = dict(s.counts)
            if s.kind == "attention":
                heads = counts["attention heads"]
                why = (f"{n} key/value heads cannot give each of {size} ranks a whole one: a rank takes whole "
                       f"key/value heads, each with its {heads // n} query heads (grouped-query attention)"
                       if heads != n else f"{heads} attention heads cannot give each of {size} ranks a whole head")
            else:
                why = f"an MLP width of {n} cannot give each of {size} ranks a column"
            raise UsageError(f"{where}: {why}",
                             f"use at most {n} rank{'s' * (n != 1)} for tensor parallelism (put the others in data or pipeline "
                             "parallelism), or a model with more heads")
        out.append(proportional_shares(n, speeds))
    return out


def shard_uneven(model: nn.Module, splits: list[Split], counts: list[tuple[int, ...]], rank: int,
                 group=None) -> nn.Module:
    """Replace every split's Linears by this rank's ShardedLinear (the units `counts` give it)."""
    for s, per_rank in zip(splits, counts):
        n = sum(per_rank)
        u0 = sum(per_rank[:rank])
        u1 = u0 + per_rank[rank]
        for name in s.colwise:
            _swap(model, name, 0, u0, u1, n, group)
        _swap(model, s.rowwise, 1, u0, u1, n, group)
    return model


def _swap(model: nn.Module, name: str, dim: int, u0: int, u1: int, n: int, group) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, child)
    width = linear.weight.shape[dim]
    if width % n:   # find_splits and the HF plan check whole heads; a plan= entry may not
        raise UsageError(f"{name!r}: {width} features are not {n} whole units",
                         "pass speeds only for models whose heads and widths tp_plan finds")
    per = width // n
    setattr(parent, child, ShardedLinear(linear, dim=dim, start=u0 * per, stop=u1 * per, group=group))


def localize_uneven(model: nn.Module, splits: list[Split], counts: list[tuple[int, ...]], rank: int) -> None:
    """Head-count attributes an attention module views its heads with, as this rank's share of
    them: total · (its units / all units) (see styles._attention)."""
    modules = dict(model.named_modules())
    for s, per_rank in zip(splits, counts):
        for attr, total in s.head_attrs:
            setattr(modules[s.module], attr, total * per_rank[rank] // sum(per_rank))


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of which each rank holds only its part (the rest are whole on every rank)."""
    return [p for m in model.modules() if isinstance(m, ShardedLinear) for p in m.sharded()]


def clip_grad_norm(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """clip_grad_norm_ over the whole model: the squares of the sharded gradients summed over the
    group (one all-reduce), the whole ones counted once; every rank scales by the same factor."""
    sharded = {id(p) for p in sharded_parameters(model)}
    device = next(model.parameters()).device     # the job's: the model lives there
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=device)
    part = torch.zeros((), dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if id(p) in sharded:
            part += sq
        else:
            whole += sq
    dist.all_reduce(part, group=group)
    total = (part + whole).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
