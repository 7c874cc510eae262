"""Optimizer state held in slices (capacity and capacity-full sharding): a fresh optimizer's state
created, which entries follow the slice's elements, and a checkpoint's per-parameter state put back
into the slice a rank holds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...errors import HetrainError


def elementwise(value, local: torch.Tensor) -> bool:
    """Whether an optimizer state entry has one element per element of `local` (exp_avg does; a
    scalar step count does not)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == local.numel()


def check_groups(optim_sd: dict, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The checkpoint's param groups, refused before anything is overwritten if they do not match."""
    groups = optim_sd["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise HetrainError(f"the checkpoint's optimizer has {len(groups)} param group(s), this one "
                           f"{len(optimizer.param_groups)}", "resume with the optimizer the checkpoint was saved with")
    return groups


def restore_entries(held: dict, saved: dict, local: torch.Tensor,
                    put: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Saved per-parameter state into `held` (this rank's state of `local`): element-wise entries
    through put(held entry, saved whole tensor), which copies the slice; the others whole."""
    for k, v in saved.items():
        if k in held and elementwise(held[k], local):
            put(held[k], v)
        elif isinstance(held.get(k), torch.Tensor):
            held[k].copy_(v)
        else:
            held[k] = v


def restore_groups(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    for mine, saved in zip(optimizer.param_groups, groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})   # lr & co; the step copies them down


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create a fresh local optimizer's state (as DCP's get_state_dict does: one step with zero
    gradients and lr 0), so that loading has tensors to fill; parameters and gradients unchanged."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optim.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optim.step()
    for g, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad      # the same tensor: capacity's gradient views stay views
