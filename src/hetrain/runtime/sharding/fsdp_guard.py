"""In-loop OOM recovery under FSDP2: complete the step's collectives an OOM cut short, then redo.

What is true of FSDP2 as hetrain runs it (runtime/sharding/wrap.py): every rank issues the same
collectives in every step, in the same order, whatever its micro-batch count — all-gathers of the
root and of each block in its first forward, then the last micro-batch's backward all-gathers and
reduce-scatters. They all go through two objects per unit, FSDP2's public hooks
`set_custom_all_gather` / `set_custom_reduce_scatter`; hetrain installs recording ones, so a rank
knows exactly which collectives of the step it has issued (kind, elements, dtype, group).

The sequence itself is learnt once, in prepare(), by one forward/backward on two samples (every
rank together; gradients, RNG and buffers restored): the step's template. An OOM anywhere in a step
— forward or backward, any micro-batch, one micro-batch or several — leaves this rank a prefix of
the template issued; its peers wait in the next one or will issue the rest. `complete_missing()`
issues that suffix with zero buffers (a zero adds nothing to a reduce-scatter; an all-gather of
zeros is thrown away), the step's agreement marks it desynced, and every rank discards the step
(`reset()`: FSDP2's own `reset_iter_state()`, plus the unsharded gradients it leaves) and redoes it
with the smaller micro-batch.

What cannot be done in-loop, and fails loudly instead: a step whose collectives differ from the
template (data-dependent control flow that skips a block). Its suffix is unknown, so the rank
raises (its process ends; gloo/NCCL peers see the broken connection and the job stops or restarts
from its checkpoint) rather than guessing a collective and corrupting or hanging its peers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...errors import HetrainError
from ..ranks.torch_compat import all_gather_single, reduce_scatter_single


@dataclass(frozen=True)
class Collective:
    kind: str                    # "all_gather" | "reduce_scatter"
    numel: int                   # elements of this rank's input
    dtype: torch.dtype
    device: torch.device = field(compare=False)
    group: object = field(compare=False)
    op: object = field(default=None, compare=False)     # reduce-scatter's op (sum, avg, premul-sum)


class _Allocating:
    """What FSDP2's default collectives allocate with (the `Comm.allocate` part of the interface)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RecordingAllGather(_Allocating):
    """FSDP2's default all-gather (`all_gather_single`; `all_gather_into_tensor` before torch 2.13),
    recorded once it is issued."""

    def __init__(self, issued: list[Collective]):
        self.issued = issued

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        work = all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        self.issued.append(Collective("all_gather", input_tensor.numel(), input_tensor.dtype,
                                      input_tensor.device, group))
        return work


class RecordingReduceScatter(_Allocating):
    """FSDP2's default reduce-scatter (`reduce_scatter_single`; `reduce_scatter_tensor` before torch
    2.13), recorded once it is issued."""

    def __init__(self, issued: list[Collective]):
        self.issued = issued

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        work = reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        self.issued.append(Collective("reduce_scatter", input_tensor.numel(), input_tensor.dtype,
                                      input_tensor.device, group, op))
        return work


class FSDPGuard:
    """The SyncGuard interface for FSDP2 (runtime/resilience/oom.py): start_attempt(), begin(),
    complete_missing(), reset()."""

    every_oom_desyncs = True     # an OOM anywhere in the step leaves collectives owed: always agreed

    def __init__(self, root: nn.Module, units: list[nn.Module]):
        self.root, self.units = root, [*units, root]
        self.issued: list[Collective] = []
        self.template: list[Collective] | None = None
        self._stale: set[int] = set()    # units whose unsharded gradients a broken step may have left
        self.allocating = contextlib.nullcontext   # a metered device meters the completion (MemoryMeter.allocating)
        for unit in self.units:
            unit.set_custom_all_gather(RecordingAllGather(self.issued))
            unit.set_custom_reduce_scatter(RecordingReduceScatter(self.issued))
            unit.register_forward_pre_hook(self._clear_stale_grads)

    def learn(self, run_one_step: Callable[[], None]) -> int:
        """Record the collectives of one whole step (a collective: every rank runs the same step)."""
        self.issued.clear()
        run_one_step()
        self.template = list(self.issued)
        self.issued.clear()
        return len(self.template)

    def start_attempt(self) -> None:
        """A step's attempt begins: its collectives start with its first micro-batch."""
        self.issued.clear()

    def begin(self) -> None:
        """Before the last micro-batch: nothing to do, the record runs from start_attempt()."""

    def complete_missing(self) -> int:
        """Issue, with zeros, every collective of the template this attempt has not; returns how many."""
        done, template = len(self.issued), self.template
        if template is None or self.issued != template[:done]:
            raise HetrainError(
                "out of memory under FSDP2 in a step whose collectives differ from the recorded step "
                f"({done} issued, {'none' if template is None else len(template)} recorded): the ones its "
                "peers wait for are unknown, so this rank stops rather than hang them",
                "keep the model's forward the same in every step (no skipped blocks), or sharding='none'")
        missing = template[done:]
        with self.allocating():
            for c in missing:      # one collective's zeros at a time: each freed before the next
                ws = dist.get_world_size(c.group)
                if c.kind == "all_gather":
                    out = torch.zeros(c.numel * ws, dtype=c.dtype, device=c.device)
                    all_gather_single(out, out.narrow(0, dist.get_rank(c.group) * c.numel, c.numel), group=c.group)
                    del out
                else:
                    reduce_scatter_single(torch.zeros(c.numel // ws, dtype=c.dtype, device=c.device),
                                          torch.zeros(c.numel, dtype=c.dtype, device=c.device), group=c.group, op=c.op)
        self.issued[:] = template
        return len(missing)

    def reset(self) -> None:
        """Every rank, after an agreed redo: FSDP2's recovery from a broken forward/backward
        (`reset_iter_state`: in-flight collectives waited for, every unit resharded, its trackers
        cleared). It keeps the unsharded parameters' `.grad` (a no_sync pass accumulates there), so
        each unit clears them the next time it unshards, before its forward computes."""
        self.root.zero_grad(set_to_none=True)
        self.root.reset_iter_state()
        self._stale = {id(u) for u in self.units}

    def _clear_stale_grads(self, module: nn.Module, args) -> None:
        # After FSDP2's own pre-forward (registered first), so the unit's unsharded parameters are
        # the ones registered on it now; hetrain's FSDP2 has no reduce dtype, so no gradient lives
        # elsewhere (FSDPParam.unsharded_accumulated_grad stays None).
        if id(module) in self._stale:
            self._stale.discard(id(module))
            for p in module.parameters():
                p.grad = None


def one_step(model: nn.Module, batch, *, forward, autocast, device: torch.device) -> None:
    """One forward/backward that leaves nothing behind: gradients cleared, RNG and buffers
    (BatchNorm statistics) as they were."""
    from ..user_objects import as_scalar

    buffers = [b.detach().clone() for b in model.buffers()]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast():
            loss = as_scalar(forward(model, batch))
        loss.backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
