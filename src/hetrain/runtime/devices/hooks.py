"""What a device adds to the training loop: its clock, and on emulated devices the throttle, the
memory meter and injected faults. The loop (runtime/loop/stepping.py, engine.py) calls the same hooks on every
device; `DeviceHooks` itself does nothing but keep time, so on a real GPU without faults the hot
path is: forward, weighted backward, gradient sync, agreement, optimizer step.

  DeviceHooks     a plain CPU (thread CPU time) or the base of the others
  CudaHooks       a GPU: compute time from CUDA events, read once per step after the sync
  EmulatedHooks   a CPU thread playing a GPU: throttle + memory meter (runtime/devices/emulation.py) + runtime/devices/faults.py

Busy time is what the rebalancer and the summary see: compute as the device experiences it, never
time spent waiting for peers (CPU time, plus the emulation's charged sleeps; GPU event time). Every
figure is read on the device's clock (runtime/devices/clock.py), the optimizer's part of a step too
(`fixed_start`/`fixed_end`, read by `last_fixed_s` at the next step's agreement).
"""

from __future__ import annotations

import contextlib

import torch

from . import clock as clocks
from .faults import FaultInjector, injected_oom


class DeviceHooks:
    """No emulation, no faults: a clock and nothing else."""

    def __init__(self, device: torch.device, throttle=None):
        # CPU: this thread's CPU time, so waits in collectives are not counted as compute; an
        # emulated device's clock adds what its throttle charged (devices/clock.py DeviceClock)
        self.device_clock = clocks.DeviceClock(device, throttle=throttle)
        self.clock = self.device_clock.host_part     # what a piece's compute is booked by
        self._fixed0, self._fixed = None, None   # device-clock marks around the last step's optimizer part
        self.compute_s = 0.0       # this attempt of the step: forward + backward, unthrottled
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
        """The step's forward + backward compute (unthrottled), for the step's agreement table."""
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
        return (clocks.host(), runqueue_s(), self._slept()) if mb.last else None

    def _slept(self) -> float:
        throttle = self.device_clock.throttle
        return throttle.slept_seconds if throttle is not None else 0.0

    def backward_wall(self, mark, backward_s: float) -> None:
        """The last micro-batch's backward runs the gradient sync: the wall time it took beyond
        its own compute (this clock: the thread's CPU time on a CPU) is time blocked there (the
        all-reduce, and any wait in it for slower peers), less the time the thread was ready but
        not running (a busy host; it stays in the step's remainder, not in the sync), and less an
        asynchronous emulated device's sleep paid there (its own compute, at the sync point)."""
        if mark is not None:
            wall0, queued0, slept0 = mark
            queued, slept = runqueue_s() - queued0, self._slept() - slept0
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
        """Where injected faults strike in the model (emulated devices only)."""

    def after_backward(self, mb, backward_s: float) -> None:
        self._booked = self._forward_s + backward_s

    def attempt_failed(self) -> None:
        """A micro-batch ran out of memory; its attempt of the step is over."""

    # -- the rest of the step -------------------------------------------------------------------
    def step_start(self, step_index: int) -> None:
        """Before the step's first micro-batch (faults set the slowdown in force, or strike; the
        step's memory peak starts afresh)."""

    def optimizer(self):
        return contextlib.nullcontext()

    def after_optimizer(self, module, optimizer) -> None:
        """After the optimizer step (the emulated meter counts optimizer state once it exists)."""

    def state_restored(self, module, optimizer) -> None:
        """A checkpoint's optimizer state was loaded (the emulated meter counts it from now on)."""

    def peak_bytes(self) -> float:
        return 0.0

    def step_peak_bytes(self) -> float:
        """The most this device held since the step started (0: not measured, a plain CPU)."""
        return 0.0


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


class EmulatedHooks(DeviceHooks):
    """A CPU thread playing a GPU: its throttle and memory meter (runtime/devices/emulation.py), and injected faults."""

    def __init__(self, device: torch.device, emulated, faults: FaultInjector):
        super().__init__(device, throttle=emulated.throttle)
        self.emulated = emulated
        self.throttle = emulated.throttle
        self.meter = emulated.meter
        self.faults = faults
        self._state_counted = False
        self._guess = 0.0              # the throttle's prediction of the micro-batch's backward
        self._forward_oom = None       # a fault to raise in the next forward
        self._in_flight = None         # (micro-batch, step) running now, for a fault armed in forward
        self._output_site = False      # backward faults strike from the site's output gradient

    def step_start(self, step_index: int) -> None:
        self.meter.start_step()
        faults = self.faults
        if not faults:
            return
        faults.at_step_start(step_index)
        escaped = faults.oom(step_index, 0, 1, "forward", escape=1)
        if escaped is not None:      # as if the user's code ran out of memory outside `with mb:`
            raise injected_oom(escaped)
        self.throttle.slowdown = faults.slowdown(step_index)
        self.throttle.noise = faults.noise(step_index)

    def micro_batch_start(self, mb, step_index: int) -> None:
        self._forward_oom = self.faults.oom(step_index, mb.index, mb.count, "forward", escape=0) if self.faults else None
        self._in_flight = (mb, step_index)
        if self._forward_oom is not None or self._backward_oom_due(mb, step_index):
            self.meter.count_next = True       # its graph tracked, to be held after the OOM (held_memory.py)
        super().micro_batch_start(mb, step_index)

    def attach_faults(self, model, *, block_type: str | None, sharded: bool) -> None:
        """Faults strike inside the compute: a forward OOM from a pre-hook on the middle block (the
        model itself when it has no blocks), which runs after FSDP2's own pre-forward all-gather
        of that block, as a real OOM in its activations would. Under FSDP2 (`sharded`) a backward
        fault strikes from the gradient of that block's output, half-way through the backward: the
        sharded parameters get their gradients from FSDP2's reduce-scatter, not from autograd, so a
        hook on one of them would never fire."""
        from ..user_objects import find_blocks

        blocks = [m for _, m in find_blocks(model, block_type)]
        site = blocks[len(blocks) // 2] if blocks else model
        site.register_forward_pre_hook(lambda module, args: self.before_forward())
        self._output_site = sharded
        if sharded:
            site.register_forward_hook(self._arm_backward)

    def before_forward(self) -> None:
        """From a forward pre-hook on the fault site: an injected OOM strikes inside the forward."""
        if self._forward_oom is not None:
            fault, self._forward_oom = self._forward_oom, None
            raise self._injected(fault)

    def _injected(self, fault) -> torch.OutOfMemoryError:
        """An injected OOM, whose failed graph the meter holds until it is released."""
        self.meter.out_of_memory()
        return injected_oom(fault)

    def _backward_oom_due(self, mb, step_index: int) -> bool:
        faults = self.faults
        return bool(faults) and any(faults.due("oom", step_index, micro=m, phase="backward", escape=0)
                                    for m in (mb.index, mb.index - mb.count))

    def _arm_backward(self, module, args, output) -> None:
        """Forward hook on the fault site (FSDP2): a backward fault due in this micro-batch
        strikes when the gradient of the site's output arrives."""
        if self._in_flight is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        mb, step_index = self._in_flight
        faults = self.faults
        due = self._backward_oom_due(mb, step_index)
        die = mb.last and faults.due("die", step_index, phase="backward")
        if due or die:
            output.register_hook(self._strike(mb, step_index, die))

    def _strike(self, mb, step_index: int, die: bool):
        def boom(grad):
            if die:
                self.faults.maybe_die(step_index, "backward")
            oom = self.faults.oom(step_index, mb.index, mb.count, "backward", escape=0)
            if oom is not None:
                raise self._injected(oom)
        return boom

    def micro_batch_end(self, mb) -> None:
        # what ran after backward() (forward and backward are booked already) is throttled too
        self.throttle.charge(self.clock() - self._started - self._booked)
        super().micro_batch_end(mb)

    def before_backward(self, mb) -> None:
        super().before_backward(mb)
        # sleep first, once per step, before the backward that syncs: see emulate.Throttle
        self._guess = self.throttle.before_backward(self._forward_s, settle=mb.last, samples=mb.size)

    def after_backward(self, mb, backward_s: float) -> None:
        self.throttle.after_backward(self._forward_s, self._guess, backward_s)
        super().after_backward(mb, backward_s)

    def attempt_failed(self) -> None:
        self.throttle.settle()      # the failed attempt's sleep belongs to it, not to the redo

    @contextlib.contextmanager
    def backward_scope(self, mb, step_index: int, module):
        """Injected faults strike from a parameter's gradient hook halfway through the model, so
        part of the gradient sync has already started, as with a real OOM or crash in backward."""
        faults = self.faults
        if self._output_site:          # armed in the forward instead (attach_faults)
            yield
            return
        oom = faults.oom(step_index, mb.index, mb.count, "backward", escape=0) if faults else None
        die = bool(faults) and mb.last and faults.due("die", step_index, phase="backward")
        if oom is None and not die:
            yield
            return
        params = [p for p in module.parameters() if p.requires_grad]

        def boom(grad):
            if die:
                faults.maybe_die(step_index, "backward")
            raise self._injected(oom)

        handle = params[len(params) // 2].register_hook(boom)
        try:
            yield
        finally:
            handle.remove()

    def optimizer(self):
        return self.throttle.compute()

    def after_optimizer(self, module, optimizer) -> None:
        if not self._state_counted and has_state(optimizer):
            self.meter.set_fixed(module, optimizer)       # optimizer state now exists
            self._state_counted = True

    def state_restored(self, module, optimizer) -> None:
        """A resumed optimizer's state is held from the start."""
        if has_state(optimizer):
            self.meter.set_fixed(module, optimizer)
            self._state_counted = True

    def peak_bytes(self) -> float:
        return float(self.meter.peak)

    def step_peak_bytes(self) -> float:
        return float(self.meter.step_peak)


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds state yet (wrappers such as ZeRO keep it in `.optim`)."""
    inner = getattr(optimizer, "optim", None)
    return bool(optimizer.state) or (isinstance(inner, torch.optim.Optimizer) and bool(inner.state))


def make_hooks(device: torch.device, emulated, faults: FaultInjector) -> DeviceHooks:
    if emulated is not None:
        return EmulatedHooks(device, emulated, faults)
    if device.type == "cuda":
        return CudaHooks(device)
    return DeviceHooks(device)
