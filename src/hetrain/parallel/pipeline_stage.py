"""One pipeline stage as a device runs it (parallel/pipeline.py builds them): each micro-batch's
forward and backward piece throttled to the emulated speed and its activations counted in flight,
and the loss over the real rows of padded micro-batches, weighted by n_k/N."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage

from ..runtime.loop import reduce
from .blocks import SavedBytes


class Flight:
    """Micro-batches (and their saved bytes) held between forward and backward."""

    def __init__(self, skip: set[int], count_bytes: bool):
        self.skip, self.count_bytes = skip, count_bytes
        self.held: dict[int, int] = {}
        self.bytes = self.peak_bytes = 0
        self.peak_count = 0

    def forward(self, chunk: int, run: Callable):
        counter = SavedBytes(self.skip)
        if self.count_bytes:
            with counter.hooks():
                out = run()
        else:
            out = run()
        self.held[chunk] = counter.bytes
        self.bytes += counter.bytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_count = max(self.peak_count, len(self.held))
        return out

    def backward_done(self, chunk: int) -> None:
        self.bytes -= self.held.pop(chunk, 0)


class MeteredStage(PipelineStage):
    """A PipelineStage whose per-micro-batch compute pieces are throttled and metered."""

    def __init__(self, *args, throttle=None, flight: Flight, **kwargs):
        super().__init__(*args, **kwargs)
        self._throttle = throttle
        self._flight = flight
        self.compute_s = 0.0

    def timed(self, run: Callable):
        # Wall time, not CPU time: a piece holds no communication (the schedule waits for its
        # inputs before and sends after), so its wall time is its compute. Scaling wall time keeps
        # the devices' speed ratio even when a shared CPU slows every process (CPU time would
        # not: the fast device would slow down while the slow one's sleep stayed the same).
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            spent = time.perf_counter() - t0
            self.compute_s += spent
            if self._throttle is not None:
                self._throttle.pay(spent)

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        parent = super().forward_one_chunk
        return self.timed(lambda: self._flight.forward(
            fwd_chunk_id, lambda: parent(fwd_chunk_id, args, kwargs, save_forward_output)))

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        parent = super().backward_one_chunk
        out = self.timed(lambda: parent(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward))
        self._flight.backward_done(bwd_chunk_id)
        return out


class RowLoss:
    """The schedule's loss: targets arrive as row ids (-1: padding); the user's mean loss over
    the real rows, weighted by n_k·D/N so the summed gradient is the big-batch gradient."""

    def __init__(self, loss_fn: Callable, *, replicas: int, timed: Callable):
        self.loss_fn, self.replicas, self.timed = loss_fn, replicas, timed
        self.targets: torch.Tensor | None = None
        self.total = 1

    def begin(self, targets: torch.Tensor | None, total: int) -> None:
        self.targets, self.total = targets, total

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        def run():
            real = rows >= 0
            n = int(real.sum())
            loss = self.loss_fn(output[real], self.targets[rows[real]])
            return loss * reduce.loss_factor(units=n, world_size=self.replicas, global_batch=self.total)
        return self.timed(run)
