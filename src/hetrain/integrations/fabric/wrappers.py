"""What fabric.setup / setup_module / setup_optimizers return under HetrainStrategy (Fabric then
wraps them in its own _FabricModule and _FabricOptimizer).

They exist because Fabric lets the model, the optimizer and the data be set up in any order, and
hetrain can only wrap the model (DDP, the OOM guard, a sharding that may replace the optimizer)
once it has all three: it measures the model on the data to plan the shares. Until then these
stand for the user's own objects; once hetrain has prepared them, for hetrain's.

The optimizer's zero_grad (and the step of a scheduler given to fabric.setup) is also where
Fabric's own loop (`optimizer.zero_grad()` every batch) meets hetrain's accumulation: a batch of
that loop is one micro-batch of this rank's share,
and the gradient of the global step builds up over all of them. zero_grad inside a step is
therefore a no-op (hetrain zeroes the gradients itself after every optimizer step and before a
redo); outside one it is the optimizer's. The same for scheduler.step(): stepped every batch, as a
stock loop does, it would move the learning rate once per micro-batch; it acts once per global step.
"""

from __future__ import annotations

import torch
from torch import nn


class FabricModel(nn.Module):
    """The user's module until hetrain prepared it, then hetrain's model (DDP with uneven shares,
    its device hooks' memory meter). Parameters, train()/eval() and state_dict are the
    user's module's either way (Fabric's wrapper reads state_dict from the user's module)."""

    def __init__(self, module: nn.Module, strategy):
        super().__init__()
        self.module = module
        object.__setattr__(self, "hetrain_strategy", strategy)    # not a submodule

    def forward(self, *args, **kwargs):
        strategy = self.hetrain_strategy
        prepared = strategy.engine.model if strategy.engine is not None else None
        if prepared is None:
            return self.module(*args, **kwargs)
        if not strategy.in_step():
            # Evaluation, between steps: ranks run different numbers of batches there
            # (fabric/evaluation.py), and DDP's forward may run collectives of its own (buffers
            # broadcast, its buckets' rebuild). The user's module holds the same parameters.
            return prepared.module(*args, **kwargs)
        strategy.plain.forwards += 1
        try:
            return prepared(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            if not strategy.plain.settles():
                raise
            failed = f"forward: {e}".splitlines()[0][:200]
        # Out of the except block: its traceback no longer holds the failed forward's graph.
        strategy.plain.forward_oom(failed)   # Fabric's own loop: settled with the peers, one error on all
        raise torch.OutOfMemoryError(failed)


def _target(opt) -> torch.optim.Optimizer:
    """The optimizer an optimizer step and zero_grad act on: hetrain's once it prepared (sharding
    may replace the user's), the user's before. `opt` is this wrapper, or Fabric's around it (whose
    unknown attributes Fabric forwards here)."""
    engine = opt.hetrain_strategy.engine
    prepared = engine.optimizer if engine is not None else None
    return prepared if prepared is not None else opt.hetrain_optimizer


class FabricOptimizer(torch.optim.Optimizer):
    """The user's optimizer, seen through hetrain. A subclass of Optimizer so that LR schedulers
    and isinstance checks accept it (Fabric builds its own wrapper's class from this one's); it
    holds no state itself: every attribute is the target optimizer's. Methods here may run with
    `self` being Fabric's wrapper, so they read only attributes Fabric forwards (hetrain_*)."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy):   # no Optimizer.__init__: no state here
        self.hetrain_optimizer = optimizer
        self.hetrain_strategy = strategy

    def __getattr__(self, name: str):
        if name.startswith("hetrain_"):      # not set yet (unpickling, say): not the target's to answer
            raise AttributeError(name)
        return getattr(_target(self), name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op inside a global step (the micro-batches' gradients accumulate); else the
        optimizer's."""
        if self.hetrain_strategy.in_step():
            return
        _target(self).zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """Reached only by calling this object's step directly (Fabric's wrapper calls the
        strategy): the same as optimizer.step() through Fabric."""
        return self.hetrain_strategy.optimizer_step(self) if closure is None else \
            self.hetrain_strategy.optimizer_step(self, closure=closure)

    def state_dict(self):
        return _target(self).state_dict()

    def load_state_dict(self, state_dict) -> None:
        _target(self).load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        _target(self).add_param_group(param_group)

    def __repr__(self) -> str:
        return f"FabricOptimizer({_target(self)!r})"


class FabricScheduler:
    """The LR scheduler given to fabric.setup(model, optimizer, scheduler=...): step() is a no-op
    inside a global step, so a loop that steps it every batch steps it once per optimizer step.
    Everything else is the scheduler's (hetrain checkpoints the scheduler itself)."""

    def __init__(self, scheduler, strategy):
        self.hetrain_scheduler = scheduler
        self.hetrain_strategy = strategy

    def step(self, *args, **kwargs) -> None:
        if not self.hetrain_strategy.in_step():
            self.hetrain_scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("hetrain_"):
            raise AttributeError(name)
        return getattr(self.hetrain_scheduler, name)

    def __repr__(self) -> str:
        return f"FabricScheduler({self.hetrain_scheduler!r})"
