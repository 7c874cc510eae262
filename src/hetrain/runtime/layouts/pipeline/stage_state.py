"""A pipeline stage's part of a checkpoint, in the layout every other layout uses.

torch.distributed.checkpoint keys each entry by the *whole* model's names ("blocks.3.fc.weight",
"optim.state.blocks.3.fc.weight.exp_avg"), as get_state_dict does under data parallelism
(runtime/sharding/state.py). A stage saves the entries of the parameters and buffers it holds and
loads the ones it holds now, so a checkpoint moves between stage counts, between pipeline and
data-parallel layouts, and between world sizes: DCP reshards by name. A tied weight held by two
stages is saved by both under its names (DCP keeps one copy of equal keys).
"""

from __future__ import annotations

import torch
from torch import nn

from ...sharding.state import init_optimizer_state


class StageState:
    def __init__(self, pipe, optimizer: torch.optim.Optimizer, model: nn.Module):
        self.pipe, self.optimizer, self.model = pipe, optimizer, model

    def _model_entries(self) -> dict[str, torch.Tensor]:
        held = {id(t) for t in (*self.pipe.module.parameters(), *self.pipe.module.buffers())}
        named = [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers(remove_duplicate=False)]
        return {name: t.detach() for name, t in named if id(t) in held}

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.pipe.named_parameters()}

    def _optim_entries(self) -> dict:
        names = self._names()
        opt = self.optimizer
        state = {names[id(p)]: dict(opt.state[p]) for g in opt.param_groups for p in g["params"] if p in opt.state}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(whole)}
                  for g, whole in zip(opt.param_groups, self.pipe.group_names)]
        return {"state": state, "param_groups": groups}

    def save_dicts(self) -> tuple[dict, dict]:
        return self._model_entries(), self._optim_entries()

    def load_dicts(self) -> tuple[dict, dict]:
        init_optimizer_state(self.optimizer)      # tensors for DCP to fill in place
        return self._model_entries(), self._optim_entries()

    def set_loaded(self, model_sd: dict, optim_sd: dict) -> None:
        """DCP filled the tensors in place (the model's entries are views of its parameters, the
        optimizer's its state tensors); put back what it replaced: non-tensor values and the
        hyperparameters of each param group."""
        names = self._names()
        opt = self.optimizer
        for g in opt.param_groups:
            for p in g["params"]:
                saved = optim_sd["state"].get(names[id(p)])
                if saved is None:
                    continue
                held = opt.state[p]
                for k, v in saved.items():
                    if isinstance(held.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                        if held[k] is not v:
                            held[k].copy_(v)
                    else:
                        held[k] = v
        for mine, saved in zip(opt.param_groups, optim_sd["param_groups"]):
            mine.update({k: v for k, v in saved.items() if k != "params"})
