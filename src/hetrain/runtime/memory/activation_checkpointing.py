"""Activation checkpointing per block, on the devices that need it.

A block's forward runs under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: only
the block's input is kept for backward, and its inside is recomputed there. Gradients are
unchanged (the recomputation replays the same ops, RNG state included); the saved activations
drop from every block's inside to one tensor per block (measured on the demo GPT: 7x fewer bytes).

Blocks are the modules of the model's ModuleLists (the GPT's `blocks`; the outermost lists only),
or every module of a class the user names (`Memory(blocks='Block')`). The forward is replaced
on the block instance, not by wrapping the module, so parameter names, state_dict keys and
`model.blocks[i]` stay as they were, and DDP/FSDP2 wrap the model exactly as without it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...errors import UsageError
from ...planning.plan import Plan
from ..user_objects import find_blocks

_MARK = "_hetrain_checkpointed"


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():      # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module, block_type: str | None = None, count: int | None = None) -> list[str]:
    """Checkpoint every block of `model`, or the first `count` of its block list (idempotent).
    Returns the names of the blocks checkpointed. A count trades memory for recompute by the
    block: each block left out keeps its inside's activations and skips its recomputation."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise UsageError(f"checkpoint_blocks(count={count!r}) is not a number of blocks",
                         "give a whole number >= 0 of blocks to checkpoint, or None for every block")
    blocks = find_blocks(model, block_type)
    if not blocks:
        raise UsageError(
            "activation checkpointing was asked for, but the model has no blocks to checkpoint "
            + (f"(no module of class {block_type!r})" if block_type else "(no nn.ModuleList of blocks)"),
            "keep the repeated layers in an nn.ModuleList, or name their class: memory=Memory(blocks='Block')")
    blocks = blocks if count is None else blocks[:count]
    for _, block in blocks:
        if not getattr(block, _MARK, False):
            block.forward = functools.partial(_checkpointed, block.forward)
            object.__setattr__(block, _MARK, True)
    return [n for n, _ in blocks]


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def decide(model: nn.Module | None, plan: Plan, *, mode: str = "plan", block_type: str | None = None) -> Plan:
    """The plan with every rank's checkpointing as it will run, nothing applied: under mode 'all'
    every block of every rank (recorded: same version, a record, not a new split), under 'plan'
    the plan's own, under 'none' the plan as it is (nothing is applied). Every rank checks the
    model (when given: a re-plan after prepare passes none) has blocks when ANY rank needs them,
    so all ranks raise the same error."""
    if mode == "none":
        return plan
    if mode == "all" and not all(d.checkpointing and d.checkpoint_blocks is None for d in plan.devices):
        from dataclasses import replace
        plan = replace(plan, devices=tuple(replace(d, checkpointing=True, checkpoint_blocks=None)
                                           for d in plan.devices))
    if model is not None and any(d.checkpointing for d in plan.devices) and not find_blocks(model, block_type):
        checkpoint_blocks(model, block_type)   # raises the UsageError, on every rank alike
    return plan


def apply_from_plan(model: nn.Module, plan: Plan, rank: int, *, mode: str = "plan",
                    block_type: str | None = None) -> tuple[Plan, list[str]]:
    """Checkpoint this rank's blocks where the plan (mode 'plan') or the config (mode 'all') asks:
    under 'plan', the first DevicePlan.checkpoint_blocks of them (None: every block).

    Returns the plan as `decide` records it and the names of the blocks this rank checkpointed."""
    plan = decide(model, plan, mode=mode, block_type=block_type)
    me = plan.devices[rank]
    if mode == "none" or not me.checkpointing:
        return plan, []
    return plan, checkpoint_blocks(model, block_type, me.checkpoint_blocks)


@contextlib.contextmanager
def applied_for_now(model: nn.Module, plan: Plan, rank: int, *, mode: str = "plan", block_type: str | None = None):
    """This rank's checkpointing as `plan` has it, for the `with` block only: what is measured in
    it (activation bytes) is what the plan will run, before the plan is final. The blocks it
    checkpointed are put back as they were (those checkpointed before stay checkpointed)."""
    if mode == "none" or not plan.devices[rank].checkpointing:
        yield
        return
    blocks = dict(find_blocks(model, block_type))
    before = {n: (is_checkpointed(b), b.__dict__.get("forward")) for n, b in blocks.items()}
    names = checkpoint_blocks(model, block_type, plan.devices[rank].checkpoint_blocks)
    try:
        yield
    finally:
        for name in names:
            block, (marked, forward) = blocks[name], before[name]
            if marked:
                continue
            block.__dict__.pop(_MARK, None)
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                object.__setattr__(block, "forward", forward)
