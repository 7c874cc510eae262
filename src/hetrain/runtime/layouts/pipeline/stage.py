"""One pipeline stage as a device runs it (layouts/pipeline/schedule.py builds them): each micro-batch's
forward and backward piece under the device's autocast, timed on the device's clock and handed to
the device after it ran (stage_hooks.StageHooks), its activations counted in flight where the
device counts its own bytes, stand-ins after an out-of-memory error; and the loss over the real
rows of padded micro-batches, weighted by D·units_k/N."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage

from ...devices import clock as clocks
from ...devices.faults import injected_oom
from ...loop import reduce
from ...ranks.islands import land, staged_p2p
from ...resilience.oom import free_cached, keep_anchor, release_graph
from .blocks import SavedBytes, stage_autocast, to_fp32
from .stage_hooks import StageHooks


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
    """A PipelineStage whose per-micro-batch compute pieces run under this device's autocast, are
    timed on its clock and handed to it (`stage_hooks`), and survive an out-of-memory error (see
    `_stand_in`)."""

    def __init__(self, *args, flight: Flight, stage_hooks: StageHooks | None = None, precision=None, faults=None,
                 micro_s: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._on = stage_hooks if stage_hooks is not None else StageHooks()
        self._micro_s = micro_s              # a micro-batch's forward+backward where the device gives it, speed 1
        self._flight = flight
        self._precision = precision
        self._faults = faults
        # Each piece's start and end on the device's clock (CUDA events; off CUDA the wall clock, and
        # what the device adds to it), read once the step has synced: `busy_s`.
        self._clock = self._on.clock(self.device)
        self._marks: list = []
        self._busy_s = 0.0
        self._wall_s = 0.0                   # off CUDA: the pieces' wall time, as measured
        self.cpu_s = 0.0                     # ... their CPU time (the probe's schedule overhead is the rest of it)
        self.pieces = 0
        self.failed: str | None = None       # why this step's pieces ran out of memory, if they did
        keep_anchor(self.device)             # before the stage's first graph: drains a failed backward's
        self._step, self._count, self._chunk = 0, 1, 0
        self._landing: dict = {}             # (phase, chunk): staged receives still to land

    def begin_step(self, step_index: int, count: int) -> None:
        self.failed, self._step, self._count = None, step_index, count

    @property
    def chunk(self) -> int:
        """The micro-batch whose forward or backward runs now (the loss follows its forward)."""
        return self._chunk

    @property
    def busy_s(self) -> float:
        """The pieces' seconds as the device was busy with them (its clock's). Reading it waits
        for the last piece on CUDA: read it after the step's sync."""
        for start, end in self._marks:
            self._busy_s += self._clock.seconds(start, end)
        self._marks = []
        return self._busy_s

    @property
    def compute_s(self) -> float:
        """The pieces' compute as measured (on CUDA, their device time: the same as busy_s)."""
        return self.busy_s if self._clock.cuda else self._wall_s

    def timed(self, run: Callable, share: float = 0.0):
        # Off CUDA, wall time, not CPU time: a piece holds no communication (the schedule waits
        # for its inputs before and sends after), so its wall time is its compute. Where the device
        # gives a micro-batch's length, a piece is its `share` of it (forward 1/3, backward 2/3;
        # the loss, outside the blocks' profile, its own time). On CUDA a piece returns once
        # launched: events time it on the device.
        start, t0, c0 = self._clock.mark(), clocks.host(), clocks.thread_cpu()
        try:
            return run()
        finally:
            spent, cpu = clocks.host() - t0, clocks.thread_cpu() - c0
            self._wall_s += spent
            self.cpu_s += cpu
            self.pieces += 1
            self._on.piece_done(self._micro_s * share if self._micro_s is not None else None, cpu, spent)
            self._marks.append((start, self._clock.mark()))

    # What a stage sends leaves once its device has computed it: the host waits for the device
    # here (clock.sync_point; on CUDA the send waits on the stream, the host does not).
    # Across device islands the pipeline's group is the gloo bridge: device tensors go through
    # host copies (runtime/ranks/islands.py staged_p2p), received ones land before their piece runs.
    def get_fwd_send_ops(self, fwd_chunk_id: int):
        clocks.sync_point()
        return staged_p2p(super().get_fwd_send_ops(fwd_chunk_id), [])

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        clocks.sync_point()
        return staged_p2p(super().get_bwd_send_ops(bwd_chunk_id), [])

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        return staged_p2p(super().get_fwd_recv_ops(fwd_chunk_id), self._landing.setdefault(("fwd", fwd_chunk_id), []))

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        return staged_p2p(super().get_bwd_recv_ops(bwd_chunk_id), self._landing.setdefault(("bwd", bwd_chunk_id), []))

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        land(self._landing.pop(("fwd", fwd_chunk_id), []))
        parent = super().forward_one_chunk
        self._chunk = fwd_chunk_id
        return self.timed(lambda: parent(fwd_chunk_id, args, kwargs, save_forward_output), share=1 / 3)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        land(self._landing.pop(("bwd", bwd_chunk_id), []))
        parent = super().backward_one_chunk
        self._chunk = bwd_chunk_id
        out = self.timed(lambda: parent(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                        last_backward=last_backward), share=2 / 3)
        self._flight.backward_done(bwd_chunk_id)
        return out

    # -- compute, and what stands in for it after an out-of-memory error ------------------------
    def forward_maybe_with_nosync(self, *args, **kwargs):
        if self.failed is None:
            chunk = self._chunk
            parent = super().forward_maybe_with_nosync
            try:
                self._strike(chunk, "forward")
                with stage_autocast(self._precision, self.device.type):
                    out = self._flight.forward(chunk, lambda: parent(*args, **kwargs))
                self._check_cap(chunk)
                return to_fp32(out) if not self.is_last else out
            except torch.OutOfMemoryError as e:
                self._fail("forward", chunk, e)
                self._flight.backward_done(chunk)
            free_cached(self.device)      # out of the except block: its traceback held the failed forward
        return self._stand_in_output()

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if self.failed is None:
            try:
                self._strike(self._chunk, "backward")
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            except torch.OutOfMemoryError as e:
                self._fail("backward", self._chunk, e)
            out = bwd_kwargs["stage_output"]       # the failed graph, released before the zeros come
            release_graph(self.device, *(out if isinstance(out, (tuple, list)) else (out,)))
            free_cached(self.device)
        # Zeros for the previous stage, shaped like this stage's inputs: it is waiting for them.
        return tuple(torch.zeros_like(v) if isinstance(v, torch.Tensor) and v.requires_grad else None
                     for v in bwd_kwargs["input_values"]), None

    def _fail(self, phase: str, chunk: int, error: Exception) -> None:
        self.failed = f"{phase} of micro-batch {chunk + 1}/{self._count}: {str(error).splitlines()[0][:160]}"

    def _stand_in_output(self):
        """What this stage sends on once it has run out of memory in this step: zeros shaped like the
        outputs the pipeline agreed at its first step (so every receive completes, and torch 2.11's
        check of every stage's output, the last's included, passes: shape, dtype and strides), needing
        grad so the schedule's backward runs through. The step is redone by every rank: these values
        are never used for a gradient that is kept."""
        metas = self._declared_outputs()
        if metas is None and self.is_last:      # nothing sent on, nothing to match: the loss's stand-in
            return torch.zeros((), device=self.device, requires_grad=True)
        if metas is None:   # before the shapes were agreed: nothing to stand in with
            raise torch.OutOfMemoryError(f"stage {self.stage_index}: out of memory before its first send ({self.failed})")
        outs = tuple(torch.empty_strided(m.shape, m.stride() if callable(m.stride) else m.stride, dtype=m.dtype,
                                         device=self.device).zero_().requires_grad_(m.dtype.is_floating_point)
                     for m in metas)
        return outs[0] if len(outs) == 1 else outs

    def _declared_outputs(self):
        """The stage's output metadata as the pipeline agreed it (None before): torch 2.13+ keeps it
        in the stage's meta record (shape, stride and dtype fields), 2.11 behind get_outputs_meta()
        (meta tensors)."""
        record = getattr(self, "_stage_meta", None)
        if record is not None:
            return record.outputs
        try:
            return self.get_outputs_meta()
        except (AssertionError, RuntimeError):      # not configured yet
            return None

    def _strike(self, chunk: int, phase: str) -> None:
        """An injected out-of-memory fault (runtime/devices/faults.py) for this micro-batch and phase."""
        if self._faults:
            fault = self._faults.oom(self._step, chunk, self._count, phase, escape=0)
            if fault is not None:
                raise injected_oom(fault)

    def _check_cap(self, chunk: int) -> None:
        """The activations in flight after this forward, told to a device that counts its own
        bytes: past its memory, the error its allocator would have raised during the forward."""
        self._on.hold(self._flight.bytes, len(self._flight.held))


class RowLoss:
    """The schedule's loss: targets arrive as row ids (-1: padding); the user's mean loss over the
    real rows of micro-batch k, weighted by D·units_k/N (runtime/loop/reduce.py) and by the
    job-wide loss scale, so the summed gradient is the big-batch gradient."""

    def __init__(self, loss_fn: Callable, *, replicas: int, stage: MeteredStage, precision=None):
        self.loss_fn, self.replicas, self.stage, self.precision = loss_fn, replicas, stage, precision
        self.targets: torch.Tensor | None = None
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.units: list[float] = []
        self.total = 1
        self.parts: dict[int, torch.Tensor] = {}   # k -> units_k · L_k (unscaled, on the device), the last computation of each

    def begin(self, targets: torch.Tensor, sizes, units, total: int) -> None:
        self.targets, self.units, self.total = targets, list(units), total
        self.starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self.sizes = list(sizes)
        self.parts = {}

    @property
    def weighted_sum(self) -> float:
        """Σ_k units_k · L_k: the step's loss, once divided by N. (torch's first step may evaluate the
        loss once more while it infers shapes: keyed by micro-batch, so that counts once.)"""
        return float(sum(self.parts.values())) if self.parts else 0.0      # one device sync per step

    def __call__(self, output, rows: torch.Tensor) -> torch.Tensor:
        def run():
            if self.stage.failed is not None or not isinstance(output, torch.Tensor) or output.dim() == 0:
                return output.sum() * 0.0 if isinstance(output, torch.Tensor) else torch.zeros(())
            # Micro-batch k's rows are its first n (padding after them, layouts/pipeline/schedule.py
            # _padded_rows): slices, not a read of `rows`, which on CUDA would wait for every
            # piece queued before it inside this timed one.
            k = self.stage.chunk
            start, n = self.starts[k], self.sizes[k]
            with stage_autocast(self.precision, output.device.type):
                loss = self.loss_fn(output[:n], self.targets[start:start + n])
            units = self.units[k]
            self.parts[k] = loss.detach().double() * units
            loss = loss.float() if loss.dtype in (torch.bfloat16, torch.float16) else loss
            scaled = loss * reduce.loss_factor(units=units, world_size=self.replicas, global_batch=self.total)
            return self.precision.scale(scaled) if self.precision is not None else scaled
        return self.stage.timed(run)
