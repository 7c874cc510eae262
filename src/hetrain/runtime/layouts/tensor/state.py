"""Checkpoint entries of a model split by speed (layouts/tensor/uneven.py), as the whole model's.

torch.distributed.checkpoint reshards DTensors, whose shards sit at torch.chunk's offsets, but a
split by speed holds plain tensors of different sizes on different ranks under one name: saved as
they are, DCP would take them for replicated copies and keep one rank's. So each sharded entry
(a ShardedLinear's weight, a column-parallel bias, their optimizer state) is saved whole, under its
whole-model name and shape: every rank puts its rows or columns into a zero tensor of the whole
shape and one all-reduce sums them (the other ranks add exact zeros, so the bits are the
shard's). Every rank then holds the same entries and DCP keeps one copy of each, so the
checkpoint is the one an unsharded model of these names would write: it loads into data
parallelism, pipelines, an even split, or another split by speed (each rank keeps its part).
Cost: each sharded tensor whole on every rank for the length of a save, and one all-reduce of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...sharding.state import init_optimizer_state
from .uneven import ShardedLinear


class ShardState:
    """The layout's `states()` for resilience/store.py: save_dicts, load_dicts, set_loaded."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, group=None):
        self.model, self.optimizer, self.group = model, optimizer, group
        self.parts = {}          # id(parameter): (dim, start, stop, whole size along dim)
        for m in model.modules():
            if isinstance(m, ShardedLinear):
                for p in m.sharded():
                    self.parts[id(p)] = (m.dim if p is m.weight else 0, m.start, m.stop, m.full)

    def _shape(self, p: torch.Tensor) -> torch.Size:
        dim, _, _, full = self.parts[id(p)]
        shape = list(p.shape)
        shape[dim] = full
        return torch.Size(shape)

    def _whole(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A collective: `value` (shaped like p's shard) as the whole tensor, on every rank."""
        dim, start, stop, _ = self.parts[id(p)]
        device = p.device              # the job's (the parameter's), wherever `value` is kept
        out = torch.zeros(self._shape(p), dtype=value.dtype, device=device)
        out.narrow(dim, start, stop - start).copy_(value)
        dist.all_reduce(out, group=self.group)
        return out

    def _local(self, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        dim, start, stop, _ = self.parts[id(p)]
        return whole.narrow(dim, start, stop - start)

    def _elementwise(self, p, v) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape

    def _entries(self):
        """The model's state dict entries (persistent buffers, tied weights under each name), as
        DCP's get_model_state_dict names them."""
        return self.model.state_dict(keep_vars=True).items()

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def _groups(self) -> list[dict]:
        names = self._names()
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                for g in self.optimizer.param_groups]

    def save_dicts(self) -> tuple[dict, dict]:
        """(model, optimizer) entries, sharded ones whole. A collective: every rank walks the
        same parameters in the same order (the same model and optimizer on every rank)."""
        init_optimizer_state(self.optimizer)     # the same keys on every rank, so the walks match
        model_sd = {}
        for name, t in self._entries():
            model_sd[name] = self._whole(t, t.detach()) if id(t) in self.parts else t.detach()
        names = self._names()
        state = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                held = self.optimizer.state[p]
                state[names[id(p)]] = {k: (self._whole(p, v) if id(p) in self.parts and self._elementwise(p, v)
                                           else v) for k, v in held.items()}
        return model_sd, {"state": state, "param_groups": self._groups()}

    def load_dicts(self) -> tuple[dict, dict]:
        """Entries for DCP to fill: whole-shaped tensors for the sharded ones, the held tensors
        (filled in place) for the rest. Local."""
        init_optimizer_state(self.optimizer)
        model_sd = {name: (torch.empty(self._shape(t), dtype=t.dtype, device=t.device) if id(t) in self.parts
                           else t.detach())
                    for name, t in self._entries()}
        names = self._names()
        state = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                state[names[id(p)]] = {
                    k: (torch.empty(self._shape(p), dtype=v.dtype, device=v.device)
                        if id(p) in self.parts and self._elementwise(p, v) else v)
                    for k, v in self.optimizer.state[p].items()}
        return model_sd, {"state": state, "param_groups": self._groups()}

    def set_loaded(self, model_sd: dict, optim_sd: dict) -> None:
        """This rank's part of what DCP filled; non-tensor values and each group's hyperparameters."""
        with torch.no_grad():
            for name, t in self._entries():
                got = model_sd[name]
                if id(t) in self.parts:
                    t.copy_(self._local(t, got))
                elif got.data_ptr() != t.data_ptr():
                    t.copy_(got)
            names = self._names()
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    saved, held = optim_sd["state"].get(names[id(p)]), self.optimizer.state[p]
                    for k, v in (saved or {}).items():
                        if isinstance(held.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                            held[k].copy_(self._local(p, v) if id(p) in self.parts and self._elementwise(p, held[k])
                                          else v)
                        else:
                            held[k] = v
        for mine, saved in zip(self.optimizer.param_groups, optim_sd["param_groups"]):
            mine.update({k: v for k, v in saved.items() if k != "params"})
