"""Model and optimizer state for checkpoints (resilience/store.py), in one format under every sharding.

    model   torch.distributed.checkpoint's model state dict (FSDP2's DTensor shards, plain tensors
            elsewhere)
    optim   DCP's own optimizer format: {"state": {parameter name: {key: value}}, "param_groups":
            [{hyperparameters..., "params": [parameter names]}]}, every element-wise value shaped
            like its parameter

sharding none / fsdp: DCP's get_state_dict / set_state_dict.
zero1: ZeroRedundancyOptimizer gives each parameter whole to one rank (its local `.optim`); that
    rank alone contributes the parameter's entries (DCP saves plain tensors per rank; the keys of
    different ranks are disjoint, so the checkpoint holds each entry once).
capacity-full: capacity_full_state.py, the same format (whole parameters too, from the slices).
capacity: a rank owns a contiguous slice of each param group's flat buffer (capacity.py), so a
    parameter's state may straddle two or more ranks. At save the pieces of such a parameter are
    reduced onto the rank owning its first element, which contributes it whole.
On load every rank asks for the whole entries of the parameters it owns now and keeps its part:
whichever sharding and world size saved the checkpoint, each parameter's state lands on the rank
that owns it in this job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# init_optimizer_state lives in optim_slices.py (capacity_full_state.py needs it too); still importable from here.
from .optim_slices import check_groups, elementwise, init_optimizer_state, restore_entries, restore_groups
from .capacity import CapacityShardedOptimizer


def _dcp_state():
    """torch.distributed.checkpoint.state_dict, imported on first use: a job that never saves
    or loads does not pay its import."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of parameter `name` (flattened) are the elements [at, at + hi - lo) of
    `local`, the tensor the local optimizer `optim` steps on this rank."""
    name: str
    shape: torch.Size
    lo: int
    hi: int
    local: torch.Tensor
    at: int
    optim: torch.optim.Optimizer

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.shape.numel()


def save_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts for dcp.save. A collective under capacity sharding."""
    if _full(optimizer):
        return _full_state().save_dicts(model, optimizer)
    if not _split(optimizer):
        return _dcp_state().get_state_dict(model, optimizer)
    pieces = _local_pieces(model, optimizer)
    state = {p.name: {k: _part(v, p) for k, v in p.optim.state[p.local].items()} for p in pieces if p.whole}
    if isinstance(optimizer, CapacityShardedOptimizer):
        state.update(_gather_straddling(model, optimizer, pieces))
    return _dcp_format(model, optimizer, state)


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts for dcp.load to fill: under zero1/capacity, the whole entries
    of every parameter this rank owns a part of. Local."""
    if _full(optimizer):
        return _full_state().load_dicts(model, optimizer)
    if not _split(optimizer):
        return _dcp_state().get_state_dict(model, optimizer)
    state = {p.name: {k: (torch.empty(p.shape, dtype=v.dtype, device=v.device) if elementwise(v, p.local)
                          else (v.clone() if isinstance(v, torch.Tensor) else v))
                      for k, v in p.optim.state[p.local].items()}
             for p in _local_pieces(model, optimizer)}
    return _dcp_format(model, optimizer, state)


def set_loaded_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, model_sd: dict, optim_sd: dict) -> None:
    """Put what dcp.load filled (from load_state_dicts) into the model and optimizer. Local."""
    if _full(optimizer):
        _full_state().set_loaded(model, optimizer, model_sd=model_sd, optim_sd=optim_sd)
        return
    if not _split(optimizer):
        _dcp_state().set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    groups = check_groups(optim_sd, optimizer)
    _dcp_state().set_model_state_dict(model, model_sd)
    for p in _pieces(model, optimizer):
        restore_entries(p.optim.state[p.local], optim_sd["state"][p.name], p.local,
                        lambda held, v, p=p: held.view(-1)[p.at:p.at + p.hi - p.lo].copy_(v.reshape(-1)[p.lo:p.hi]))
    restore_groups(optimizer, groups)


# -- who owns what ----------------------------------------------------------------------------------
def _full(optimizer) -> bool:
    from .capacity_full import FullShardedOptimizer

    return isinstance(optimizer, FullShardedOptimizer)


def _full_state():
    from . import capacity_full_state

    return capacity_full_state


def _split(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, (ZeroRedundancyOptimizer, CapacityShardedOptimizer))


def _local_optim(optimizer) -> torch.optim.Optimizer:
    return optimizer.optim       # both keep the optimizer of this rank's part in `.optim`


def _pieces(model: nn.Module, optimizer) -> list[Piece]:
    """What this rank's local optimizer holds, as pieces of named parameters."""
    names = {p: n for n, p in model.named_parameters()}
    local = _local_optim(optimizer)
    if not isinstance(optimizer, CapacityShardedOptimizer):      # ZeRO-1: whole parameters
        return [Piece(names[p], p.shape, 0, p.numel(), p, 0, local)
                for g in local.param_groups for p in g["params"]]
    out = []
    for group, (params, bounds, shard) in enumerate(optimizer.layout()):
        a, b = bounds[optimizer.rank], bounds[optimizer.rank + 1]
        for name, start, p in _offsets(params, names):
            lo, hi = max(start, a), min(start + p.numel(), b)
            if lo < hi:
                out.append(Piece(name, p.shape, lo - start, hi - start, shard, lo - a, local))
    return out


def _local_pieces(model: nn.Module, optimizer) -> list[Piece]:
    """This rank's pieces, with the local optimizer's state created (so there are tensors to save or fill)."""
    pieces = _pieces(model, optimizer)
    init_optimizer_state(_local_optim(optimizer))
    return pieces


def _dcp_format(model: nn.Module, optimizer, state: dict) -> tuple[dict, dict]:
    return _dcp_state().get_model_state_dict(model), {"state": state, "param_groups": _groups(model, optimizer)}


def _offsets(params, names):
    start = 0
    for p in params:
        yield names[p], start, p
        start += p.numel()


def _part(value, piece: Piece):
    """A value of the local state as the piece's parameter sees it (its elements, its shape)."""
    if not elementwise(value, piece.local):
        return value
    return value.reshape(-1)[piece.at:piece.at + piece.hi - piece.lo].view(piece.shape)


def _groups(model: nn.Module, optimizer) -> list[dict]:
    names = {p: n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
            for g in optimizer.param_groups]


def _gather_straddling(model: nn.Module, optimizer: CapacityShardedOptimizer, pieces: list[Piece]) -> dict:
    """The whole entries of the parameters split over ranks, on the rank owning each one's first
    element. A collective: every rank walks the same slices in the same order (the empty slice's
    rank too), with the keys of its own slice's state (the same optimizer on every rank)."""
    names = {p: n for n, p in model.named_parameters()}
    mine = {p.name: p for p in pieces}
    local = _local_optim(optimizer)
    out = {}
    for params, bounds, shard in optimizer.layout():
        held = local.state[shard]
        for name, start, p in _offsets(params, names):
            owners = [r for r in range(optimizer.world_size)
                      if max(start, bounds[r]) < min(start + p.numel(), bounds[r + 1])]
            if len(owners) < 2:
                continue
            first = owners[0]
            piece = mine.get(name)
            entry = {}
            for k, v in held.items():
                if not elementwise(v, shard):
                    entry[k] = v
                    continue
                device = shard.device          # the job's (the rank's flat parameter), wherever `v` is kept
                whole = torch.zeros(p.numel(), dtype=v.dtype, device=device)
                if piece is not None:
                    whole[piece.lo:piece.hi] = v.reshape(-1)[piece.at:piece.at + piece.hi - piece.lo]
                dst = first if optimizer.group is None else dist.get_global_rank(optimizer.group, first)
                dist.reduce(whole, dst=dst, group=optimizer.group)
                entry[k] = whole.view(p.shape).to(v.device)
            if optimizer.rank == first:
                out[name] = entry
    return out
