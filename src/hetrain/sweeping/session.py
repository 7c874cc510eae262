"""`hetrain.sweep`: what an Optuna-form `objective(trial)` asks about the trial it runs in.

    import hetrain
    def objective(trial):
        device = hetrain.sweep.device()              # "cuda:0", or "cpu" on a CPU device
        with hetrain.sweep.compute(samples=32):      # at the device's speed (a no-op on a GPU)
            ...

The worker sets the trial's context before it calls `objective`, and its environment says the
same to code that does not import hetrain: HETRAIN_SWEEP_DEVICE (the torch device),
HETRAIN_SWEEP_LABEL (the device's label), and CUDA_VISIBLE_DEVICES (its GPU alone).
In a group trial (several devices, one data-parallel job) `rank()` and `world_size()` say which
rank this is; `hetrain.init(global_batch=...)` joins the group's job there.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

from ..errors import UsageError
from .objective import TrialContext

DEVICE_ENV, LABEL_ENV = "HETRAIN_SWEEP_DEVICE", "HETRAIN_SWEEP_LABEL"
_current: TrialContext | None = None


def set_current(ctx: TrialContext | None) -> None:
    """The worker's: the trial now running in this process (None between trials)."""
    global _current
    _current = ctx
    if ctx is not None:
        os.environ[DEVICE_ENV], os.environ[LABEL_ENV] = ctx.device, ctx.label


def context() -> TrialContext:
    """The running trial's context (what `train(params, ctx)` is handed)."""
    if _current is None:
        raise UsageError("hetrain.sweep: no trial is running in this process",
                         "call it from the objective while `hetrain sweep` runs it, or read HETRAIN_SWEEP_DEVICE")
    return _current


def device() -> str:
    """The trial's torch device: "cuda:0" (its GPU, the only one it sees) or "cpu". Outside
    a trial: the environment's HETRAIN_SWEEP_DEVICE, else "cuda" when torch sees a GPU, else "cpu"."""
    if _current is not None:
        return _current.device
    if os.environ.get(DEVICE_ENV):
        return os.environ[DEVICE_ENV]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute(samples: int | None = None):
    """`with hetrain.sweep.compute(samples=n):` around a step: the device's speed (see
    TrialContext.compute); outside a trial, nothing."""
    return _current.compute(samples) if _current is not None else nullcontext()


def rank() -> int:
    return _current.rank if _current is not None else 0


def world_size() -> int:
    return _current.world_size if _current is not None else 1
