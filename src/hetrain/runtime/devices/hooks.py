"""What a device adds to the training loop: its clock, and whatever else the device needs at each
point of a step (a memory meter where no allocator counts, injected faults). The loop
(runtime/loop/stepping.py, engine.py) calls the same hooks on every device; `DeviceHooks` itself
does nothing but keep time, so on a real GPU without faults the hot path is: forward, weighted
backward, gradient sync, agreement, optimizer step.

  DeviceHooks     a plain CPU (thread CPU time) or the base of the others
  CudaHooks       a GPU: compute time from CUDA events, read once per step after the sync

Other kinds of device subclass DeviceHooks where they are made (the job's hooks come from one
factory, `make_hooks`). Busy time is what the rebalancer and the summary see: compute as the device
experiences it, never time spent waiting for peers (its clock's: CPU time, GPU event time). Every
figure is read on the device's clock (runtime/devices/clock.py), the optimizer's part of a step too
(`fixed_start`/`fixed_end`, read by `last_fixed_s` at the next step's agreement).
"""

from __future__ import annotations

import contextlib

import torch

from . import clock as clocks


class DeviceHooks:
    """A clock and nothing else (no meter, no faults)."""

    meter = None      # what counts the device's bytes where no allocator does (None: the allocator, or nothing)
    # The device's work runs when the host reaches a sync point (clocks.sync_point): a collective
    # launched from a hook calls one first. False on CUDA, whose collectives order on the stream.
    syncs_at_collectives = False

    def __init__(self, device: torch.device, device_clock: clocks.DeviceClock | None = None):
        # `device_clock`: the device's own (devices/clock.py), by default its DeviceClock: on a CPU
        # this thread's CPU time, so waits in collectives are not counted as compute
        self.device_clock = device_clock if device_clock is not None else clocks.DeviceClock(device)
        self.clock = self.device_clock.host_part     # what a piece's compute is booked by
        self._fixed0, self._fixed = None, None   # device-clock marks around the last step's optimizer part
        self.compute_s = 0.0       # this attempt of the step: forward + backward, on `clock` (host_part)
        self.busy_s = 0.0          # ... as the device experiences it
        self.sync_s = 0.0          # ... and the wall time its last backward was blocked in the gradient sync
        # the micro-batch in flight (one at a time): when it started, its forward, what is booked
        self._busy0 = self._started = self._forward_s = self._booked = 0.0

    # -- the clock ------------------------------------------------------------------------------
    def busy(self):
        """A mark on the device's clock: seconds off CUDA (CudaHooks times by events instead)."""
        return self.device_clock.mark()

    def attempt_start(self) -> None:
        self.compute_s, self.busy_s, self.sync_s = 0.0, 0.0, 0.0

    def attempt_busy_s(self) -> float:
        """The busy time of the step's micro-batches, for the step's agreement table."""
        return self.busy_s

    def attempt_compute_s(self) -> float:
        """The step's forward + backward compute as `clock` books it (`DeviceClock.host_part`: this
        thread's CPU time off CUDA, without what the device's clock adds), for the step's agreement
        table."""
        return self.compute_s

    def fixed_start(self) -> None:
        """The step's part outside its micro-batches starts (unscale, clip, optimizer step)."""
        self._fixed0 = self.device_clock.mark()

    def fixed_end(self) -> None:
        self._fixed = (self._fixed0, self.device_clock.mark())

    def last_fixed_s(self) -> float:
        """The last step's optimizer part on the device's clock (read after the next step's sync)."""
        return self.device_clock.seconds(*self._fixed) if self._fixed is not None else 0.0

    def attach(self, model) -> None:
        """The prepared model, for hooks that time its backward (CUDA)."""

    def wall_mark(self, mb):
        """Before a backward: where the wall clock (and the run queue) stand, for the last one."""
        return (clocks.host(), runqueue_s(), self.device_clock.waited_s()) if mb.last else None

    def backward_wall(self, mark, backward_s: float) -> None:
        """The last micro-batch's backward runs the gradient sync: the wall time it took beyond
        its own compute (this clock: the thread's CPU time on a CPU) is time blocked there (the
        all-reduce, and any wait in it for slower peers), less the time the thread was ready but
        not running (a busy host; it stays in the step's remainder, not in the sync), and less the
        time the host waited there for this device's own queued work (its clock's `waited_s`)."""
        if mark is not None:
            wall0, queued0, slept0 = mark
            queued, slept = runqueue_s() - queued0, self.device_clock.waited_s() - slept0
            self.sync_s = max(0.0, clocks.host() - wall0 - backward_s - queued - slept)

    def attempt_sync_s(self) -> float:
        return self.sync_s

    # -- a micro-batch --------------------------------------------------------------------------
    def micro_batch_start(self, mb, step_index: int) -> None:
        self._busy0 = self.busy()
        self._started = self.clock()
        self._booked = 0.0

    def micro_batch_end(self, mb) -> None:
        self.compute_s += self.clock() - self._started
        self.busy_s += self.busy() - self._busy0

    def before_backward(self, mb) -> None:
        self._forward_s = self.clock() - self._started

    def backward_scope(self, mb, step_index: int, module):
        return contextlib.nullcontext()

    def attach_faults(self, model, *, block_type: str | None, sharded: bool) -> None:
        """Where injected faults strike in the model (devices that inject none: nowhere)."""

    def after_backward(self, mb, backward_s: float) -> None:
        self._booked = self._forward_s + backward_s

    def attempt_failed(self) -> None:
        """A micro-batch ran out of memory; its attempt of the step is over."""

    def measuring(self):
        """How the profiler and the probes measure this device (runtime/devices/measuring.py):
        a GPU or a plain CPU as it is."""
        from .measuring import DeviceMeasuring

        return DeviceMeasuring(self.device_clock.device)

    # -- the rest of the step -------------------------------------------------------------------
    def step_start(self, step_index: int) -> None:
        """Before the step's first micro-batch (faults set the slowdown in force, or strike; the
        step's memory peak starts afresh)."""

    def optimizer(self):
        return contextlib.nullcontext()

    def after_optimizer(self, module, optimizer) -> None:
        """After the optimizer step (a meter counts optimizer state once it exists)."""

    def state_restored(self, module, optimizer) -> None:
        """A checkpoint's optimizer state was loaded (a meter counts it from now on)."""

    def model_sharded(self, module, optimizer, share: float) -> None:
        """Tensor parallelism sharded the model: this rank computes `share` of its Linear weights
        (layouts/tensor/shard.compute_share) and holds its shards' state."""

    def peak_bytes(self) -> float:
        return 0.0

    def step_peak_bytes(self) -> float:
        """The most this device held since the step started (0: not measured, a plain CPU)."""
        return 0.0

    # -- what the run's records say of the device -----------------------------------------------
    def device_label(self) -> str | None:
        """The device's name where its kind gives one (None: named by its hardware, the job's)."""
        return None

    def given_device(self) -> tuple[float, float] | None:
        """(speed relative to the catalog's 1.0, memory bytes) where the device's spec gives them
        rather than its hardware (None: a real device, measured or rated by its peak FLOP/s)."""
        return None

    def run_facts(self) -> dict:
        """The device's facts in the metrics file's start record (a kind of device that has any
        adds them; readers take a missing fact as false), and the note its summary's title adds."""
        note = self.summary_note()
        return {"devices_note": note} if note else {}

    def summary_note(self) -> str:
        """What the end-of-run summary's title adds about the devices."""
        return ""

    # -- what a pipeline stage asks of the device -----------------------------------------------
    def stage_hooks(self):
        """The device as a pipeline stage asks it (layouts/pipeline/stage_hooks.StageHooks), where
        it answers other than a device that times its own work and has an allocator; None: it
        does not."""
        return None


def runqueue_s() -> float:
    """Seconds this thread has waited, runnable, for a CPU (Linux schedstat; 0 where unknown)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class CudaHooks(DeviceHooks):
    """Compute time from CUDA events at each micro-batch's start, backward, end of backward and
    end, read after the step's sync (no synchronisation added per micro-batch). The last backward
    also waits for the gradient sync (DDP's finalize makes the stream wait for the all-reduce):
    its compute is timed to its last gradient, an event every trainable parameter's post-accumulate
    hook records (the last stands), so activation checkpointing's recompute (~3x the forward, not
    2x) is in it. Where no such hook fires (FSDP2's gradients come from its reduce-scatter), it is
    the forward times the backward/forward ratio of this device's micro-batches that do not sync,
    kept across steps (2 until one was measured)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.device = device
        self._times: list = []
        self._events: list = []
        # the event the last backward's gradient hooks record; whether it runs now; whether one did
        self._grads_done, self._watching, self._recorded = None, False, False
        self.backward_ratio = 2.0     # backward / forward of micro-batches that do not sync, kept
        self._run_peak = 0.0     # the allocator's peak is reset every step: the run's is kept here

    def step_start(self, step_index: int) -> None:
        self._run_peak = self.peak_bytes()
        torch.cuda.reset_peak_memory_stats(self.device)

    def attempt_start(self) -> None:
        super().attempt_start()
        self._times = []

    def attach(self, model) -> None:
        for p in model.parameters():
            if p.requires_grad:   # (a parameter that takes no such hook leaves the ratio to time it)
                with contextlib.suppress(RuntimeError):
                    p.register_post_accumulate_grad_hook(self._gradient_done)

    def _gradient_done(self, param) -> None:
        if self._watching:
            self._grads_done.record()
            self._recorded = True

    def micro_batch_start(self, mb, step_index: int) -> None:
        self._started = self.clock()
        self._events = [self.device_clock.mark()]
        self._grads_done, self._watching, self._recorded = None, False, False

    def before_backward(self, mb) -> None:
        super().before_backward(mb)
        self._events.append(self.device_clock.mark())
        if mb.last:
            self._grads_done, self._watching = torch.cuda.Event(enable_timing=True), True

    def after_backward(self, mb, backward_s: float) -> None:
        super().after_backward(mb, backward_s)
        self._watching = False
        self._events.append(self.device_clock.mark())

    def micro_batch_end(self, mb) -> None:
        if len(self._events) == 3:         # a micro-batch that ran out of memory is not timed
            done = self._grads_done if self._recorded else None
            self._times.append((mb.last, *self._events, self.device_clock.mark(), done))

    def _pieces(self) -> list[tuple[float, float, float, float]]:
        """(forward, backward as timed, its compute, after it) of each micro-batch, seconds."""
        clock, out = self.device_clock, []
        timed = [(last, clock.seconds(s, f), clock.seconds(f, b), clock.seconds(b, e), done, f)
                 for last, s, f, b, e, done in self._times]
        ratios = [bwd / fwd for last, fwd, bwd, *_ in timed if not last and fwd > 0]
        if ratios:
            self.backward_ratio = sum(ratios) / len(ratios)
        for last, fwd, bwd, after, done, f in timed:
            compute = bwd if not last else clock.seconds(f, done) if done is not None else fwd * self.backward_ratio
            out.append((fwd, bwd, min(compute, bwd), after))
        return out

    def attempt_busy_s(self) -> float:
        """GPU seconds in forward + backward (+ what ran after it in the micro-batch), the last
        backward's sync wait left out."""
        if not self._times:
            return self.busy_s
        return sum(fwd + compute + after for fwd, _, compute, after in self._pieces())

    def attempt_compute_s(self) -> float:   # a real device: its compute is its busy time
        return self.attempt_busy_s()

    def wall_mark(self, mb):
        return None          # the sync is read from the CUDA events instead

    def attempt_sync_s(self) -> float:
        """The last backward's GPU time beyond its compute: the sync it waited for."""
        return sum(bwd - compute for _, bwd, compute, _ in self._pieces()) if self._times else 0.0

    def peak_bytes(self) -> float:
        return max(self._run_peak, float(torch.cuda.max_memory_reserved(self.device)))

    def step_peak_bytes(self) -> float:
        """Reserved, not allocated: the allocator's segments, where fragmentation shows (an OOM
        with free bytes in the cache that fit no block)."""
        return float(torch.cuda.max_memory_reserved(self.device))


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds state yet (wrappers such as ZeRO keep it in `.optim`)."""
    inner = getattr(optimizer, "optim", None)
    return bool(optimizer.state) or (isinstance(inner, torch.optim.Optimizer) and bool(inner.state))
