"""A CPU thread playing a GPU: the device hooks of an emulated device (its throttle and memory
meter, emulation/device.py, and injected faults, runtime/devices/faults.py), and `make_hooks`, the
one place a job's device hooks are made: the runtime reaches the emulator mainly through these
hooks and the profiles measured through them (tests/unit/test_structure_emulation.py names the
other modules that import it).
"""

from __future__ import annotations

import contextlib

import torch

from ..runtime.devices.faults import FaultInjector, injected_oom
from ..runtime.devices.hooks import CudaHooks, DeviceHooks, has_state
from .clock import EmulatedClock


class EmulatedHooks(DeviceHooks):
    """A CPU thread playing a GPU: its throttle and memory meter (device.py), and injected faults.
    Its clock (clock.EmulatedClock) adds what the throttle charged to the thread's CPU time: the
    busy time the rebalancer and the summary see includes the sleeps; `compute_s` is the CPU's
    alone (unthrottled), and a backward's sync time leaves out what the throttle slept there."""

    def __init__(self, device: torch.device, emulated, faults: FaultInjector):
        super().__init__(device, EmulatedClock(device, emulated.throttle))
        self.emulated = emulated
        self.throttle = emulated.throttle
        self.meter = emulated.meter
        self.syncs_at_collectives = emulated.throttle.asynchronous   # it owes its sleeps till a sync point
        self.faults = faults
        self._sample_s = emulated.throttle.sample_s    # the controlled clock's, for the whole model
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
        from ..runtime.user_objects import find_blocks

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

    def measuring(self):
        """The profiler and probes time this device through fresh throttles of its own (profiling.py)."""
        from .profiling import EmulatedMeasuring

        return EmulatedMeasuring(self.emulated.spec, self.throttle, self.device_clock.device)

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

    def model_sharded(self, module, optimizer, share: float) -> None:
        """On the controlled clock (`Emulation.sample_s`) a micro-batch of m samples then lasts
        m·T·share/speed on a TP rank, `share` being the rank's part of the model's Linear weights
        (the matmul FLOPs it computes, the replicated head counted whole): a split by speed evens
        the ranks' times, an even split leaves the slow rank behind, as on GPUs. The meter counts
        this rank's shards, not the whole model."""
        if self._sample_s is not None:
            self.throttle.sample_s = self._sample_s * share
        self.meter.set_fixed(module, optimizer)

    def peak_bytes(self) -> float:
        return float(self.meter.peak)

    def step_peak_bytes(self) -> float:
        return float(self.meter.step_peak)

    def device_label(self) -> str:
        return self.emulated.label

    def given_device(self) -> tuple[float, float]:
        """The cluster spec's speed and memory. A pipeline sized on emulated devices keeps the
        spec's speeds as they are: its block costs are this CPU's, the speed-1.0 time (a cluster
        run slower than the CPU, as `--dilate` does, then predicts its own speed)."""
        spec = self.emulated.spec
        return spec.speed, float(spec.memory_bytes)

    def run_facts(self) -> dict:
        return {**super().run_facts(), "emulated": True}

    def summary_note(self) -> str:
        return " (emulated devices)"

    def stage_hooks(self):
        """Its throttle and meter as a pipeline stage uses them (pipeline.py), on the controlled
        clock where the job runs on one."""
        from .pipeline import EmulatedStage

        return EmulatedStage(self.throttle, self.meter, sample_s=self._sample_s)



def make_hooks(device: torch.device, emulated, faults: FaultInjector) -> DeviceHooks:
    """The job's device hooks: an emulated device's (`emulated`: its EmulatedDevice), a GPU's, or a plain CPU's."""
    if emulated is not None:
        return EmulatedHooks(device, emulated, faults)
    if device.type == "cuda":
        return CudaHooks(device)
    return DeviceHooks(device)
