"""How a device is measured, as the device states it (its hooks make it: DeviceHooks.measuring).
The profiler and the probes ask it instead of knowing what kind of device they time:

  Pace              a probe's run of work as the device runs it in training, with books of its own
  DeviceMeasuring   what the profiler and the probes ask of the device: its profile's memory and
                    cache key, the pace its passes are timed through, the profile made of what was
                    measured, the link its collectives cross, its peak FLOP/s

This module's classes are a GPU's and a plain CPU's: their work runs as it comes and a profile is
what was measured. A device whose compute time or link the runtime itself shapes makes its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from . import clock as clocks

if TYPE_CHECKING:
    import torch

    from ...hardware.host import HostFacts
    from ...planning.profile import DeviceProfile

MEANING_REAL = "against each GPU's catalog dense peak in its precision"


class Pace:
    """Work as a device runs it in training, for a probe to time, with books of its own (one per
    probe: the device's own books are the training's). As it comes, on a GPU or a plain CPU: the
    methods do nothing. A device that paces its compute books the forward's CPU and a guess of the
    backward before the backward (`before_backward`, where the step's wait for the device falls),
    the backward's real CPU after it (`after_backward`), what is still owed at `settle`, and a
    piece with no collective inside (the optimizer step) under `compute`."""

    timing = "busy time on its own clock"     # what a profile timed through it says it read

    def busy(self) -> float:
        """A mark on the device's clock: its busy time (this thread's CPU time here)."""
        return clocks.thread_cpu()

    def before_backward(self, forward_cpu: float, *, samples: int = 1) -> float:
        """The forward of `samples` samples took `forward_cpu` of CPU; returns the backward's guess."""
        return 0.0

    def after_backward(self, forward_cpu: float, guess: float, backward_cpu: float) -> None:
        """The backward took `backward_cpu` (against `guess`)."""

    def settle(self) -> None:
        """Pay now what the work so far owes."""

    def compute(self):
        """A piece of work with no collective inside (an optimizer step), as the device runs it."""
        return contextlib.nullcontext()

    def sharded(self, share: float) -> None:
        """The model was split (tensor parallelism): this rank computes `share` of it."""


class DeviceMeasuring:
    """What the profiler and the probes ask of a device. This class answers for a GPU and a plain
    CPU: measured as they are, by the host's clock (synchronised on CUDA) or, where asked, this
    thread's CPU time."""

    label_note = ""           # what a message adds to the device's name ('' : nothing)
    cpu_clock = False         # its compute time is this thread's CPU time (not the host's clock)
    mfu_meaning = MEANING_REAL

    def __init__(self, device: torch.device):
        self.device = device

    def memory_bytes(self, found: int | None) -> int | None:
        """The memory its profile is given: `found` (the allocator's usable bytes), unless the
        device's spec sets it."""
        return found

    def profile_key(self, key: str) -> str:
        """The profile cache's key for this device, from the hardware's `key`."""
        return key

    def timed_by(self) -> Pace | None:
        """A fresh pace the profiler's passes run through and are timed by (its busy time), for a
        device that keeps its own time; None: the passes run flat out, timed by the profiler's clock."""
        return None

    def extra_measures(self, model, batch_of: Callable[[int], object], fwd: Callable, *,
                       sizes: list[int], cpu_seconds: list[float]) -> dict:
        """Further profile fields the device measures after the profiler's passes, given the
        sizes timed and their median CPU seconds. None here."""
        return {}

    def as_profile(self, raw: DeviceProfile, *, label: str, key: str, memory_bytes: int | None) -> DeviceProfile:
        """The device's profile from what the profiler measured (`raw`, stored under `key`)."""
        return replace(raw, device=label, memory_bytes=memory_bytes,
                       source=raw.source.replace(f"measured on {key}", f"measured on {label}"))

    def pace(self) -> Pace:
        """A fresh pace for a probe (its own books)."""
        return Pace()

    def link(self, job, *, ring: int | None = None):
        """What the job's collectives cross beyond the process group's own transport, for a ring
        of `ring` ranks (default all): an object with `run(collective, nbytes)` for a blocking
        collective and `then(future, started, nbytes)` for a launched one; None: the transport is
        the link (a real device's)."""
        return None

    def peak_flops(self, compute: str, host: HostFacts | None) -> float | None:
        """The device's peak FLOP/s in the precision it computes in: a GPU's catalog dense peak
        (None: not in the catalog, or a plain CPU)."""
        if self.device.type != "cuda":
            return None
        import torch

        from ...hardware import catalog
        from ...planning.cost import peak_flops

        gpu = catalog.lookup(torch.cuda.get_device_name(self.device))
        return peak_flops(gpu, compute)[0] if gpu is not None else None
