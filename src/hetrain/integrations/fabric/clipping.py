"""fabric.clip_gradients under HetrainStrategy, by value (clip_val=) or by norm (max_norm=), as
stock clips the step's gradient.

Stock Fabric clips right after fabric.backward, where DDP has averaged the gradient over the
ranks. Under hetrain a batch of Fabric's loop is one micro-batch of this rank's share, and the
step's gradient is final only inside the step: after the last micro-batch's sync, the unscale of
the job's loss scale and the token correction. So a call inside a step records what it asks, and
the step applies it there, just before the optimizer step (the last call of the step counts; a
stock loop asks the same every batch). Clipping the final gradient by value is an elementwise
clamp and by norm one scale of the whole gradient, the same numbers stock clips. max_norm returns
a tensor that the step fills with the gradient's total norm before clipping, stock's return value:
read it after optimizer.step(). A rank without samples in a step (no batch to call it from)
clips as it did the step before, which is what its peers ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UsageError


@dataclass(frozen=True)
class Request:
    clip_val: float | None = None
    max_norm: float | None = None
    norm_type: float = 2.0
    error_if_nonfinite: bool = True
    norm: torch.Tensor | None = None      # max_norm: filled in by the step


class Clipping:
    """This rank's clip request for the step in progress, applied by the step (runtime/loop/stepping.py)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.request: Request | None = None
        self.last: Request | None = None

    def ask(self, request: Request) -> torch.Tensor | None:
        strategy = self.strategy
        engine = strategy.joined()
        call = "clip_val" if request.clip_val is not None else "max_norm"
        if engine.config.grad_clip is not None:
            raise UsageError(f"fabric.clip_gradients({call}=...) under HetrainStrategy(grad_clip={engine.config.grad_clip}): "
                             "two clips of one gradient", "drop one: the fabric.clip_gradients call, or grad_clip=")
        if not strategy.in_step():
            raise UsageError(f"fabric.clip_gradients({call}=...) outside a step: under HetrainStrategy the gradient "
                             "of a step is final inside the step, where the call is applied",
                             "call it between fabric.backward(loss) and optimizer.step(), as stock loops do")
        if engine.clips_in_slices and (request.clip_val is not None or request.norm_type != 2):
            raise UsageError(f"fabric.clip_gradients({call}=...{', norm_type=' + str(request.norm_type) if call == 'max_norm' else ''}) "
                             "under sharding='capacity-full': its slices clip only by the 2-norm",
                             "clip with max_norm= and norm_type=2, or HetrainStrategy(sharding='zero1' or 'fsdp')")
        strategy.pieces.steps.loop.clip_hook = self.apply
        if request.max_norm is not None:
            request = Request(max_norm=request.max_norm, norm_type=request.norm_type,
                              error_if_nonfinite=request.error_if_nonfinite,
                              norm=torch.zeros((), device=strategy.engine.device,
                                               dtype=next(engine.model.parameters()).dtype))
        self.request = request
        return request.norm

    def apply(self, _job, step) -> None:
        """In the step: after the gradient is final, before the optimizer step."""
        engine = self.strategy.engine
        request = self.request if self.request is not None or len(step.indices) else self.last
        self.request = None
        if request is None:
            return
        self.last = request
        if request.clip_val is not None:
            grads = [p for g in engine.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_value_(grads, request.clip_val)
            return
        total = engine.clip_grad_norm(request.max_norm, norm_type=request.norm_type,
                                      error_if_nonfinite=request.error_if_nonfinite)
        total = total.full_tensor() if hasattr(total, "full_tensor") else total     # FSDP2: a DTensor
        request.norm.copy_(total.detach().to(request.norm))
