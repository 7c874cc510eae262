"""Every time read in runtime/ goes through here (tests/unit/test_structure_clocks.py keeps it so).

Three kinds of time, never mixed up:

  wall(), wall_ns()   the calendar: what a record, a lock or a saved file is stamped with
  host()              the host's monotonic clock: timeouts, waits, a step's period between two
                      agreements, the emulated link's schedule. It measures no device work.
  thread_cpu()        this thread's CPU time: what an emulated device's throttle books as compute
  DeviceClock         a device's own time, for pieces of its work (forward, backward, optimizer)

A CUDA kernel runs after the host call that launched it returns, so `host()` around device work
measures the launch, not the compute; anything that reads device data inside (`.item()`, `int(t)`,
a boolean mask) adds all the work queued before it. A `DeviceClock` therefore marks CUDA work with
events (recorded in the step, read after the step's sync: no synchronisation added), and a CPU
device with this thread's CPU time (a wait for peers is not compute). An emulated device's clock
adds the compute its throttle charged (emulation/device.Throttle), whether or not the
throttle has slept it yet: with HETRAIN_EMULATE_ASYNC=1 an emulated device, like a GPU, pays
its sleeps only at the sync points, `synchronize()` and `sync_point()`, which every collective
hetrain issues in a step calls first. A timing path that reads `host()` around an emulated
device's work then misses the device's time as it would on CUDA.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a device is timed, not here: the launcher's lock and fault files are
# stamped through wall() in processes that never load torch.
_pending: weakref.WeakSet = weakref.WeakSet()   # this process's asynchronous emulated throttles


def wall() -> float:
    """Seconds since the epoch (calendar time: stamps, not durations)."""
    return time.time()


def wall_ns() -> int:
    return time.time_ns()


def host() -> float:
    """The host's monotonic clock in seconds. Device work is not in it until synchronize()."""
    return time.perf_counter()


def thread_cpu() -> float:
    """This thread's CPU seconds (waits and sleeps are not in it)."""
    return time.thread_time()


def owe(throttle) -> None:
    """An asynchronous emulated throttle of this process: its sleeps are paid at the sync points."""
    _pending.add(throttle)


def sync_point() -> None:
    """Where the host waits for an emulated device's work: before a collective, a copy to the host,
    a synchronize. The asynchronous throttles sleep what they owe (no-op otherwise, and on CUDA,
    whose collectives order themselves on the stream)."""
    for throttle in list(_pending):
        throttle.sync()


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the device's queued work: CUDA's stream, an emulated device's owed sleep."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    sync_point()


def synced(device: torch.device) -> float:
    """host(), read after the device has finished its queued work (for probes and profilers)."""
    synchronize(device)
    return host()


class DeviceClock:
    """Marks on one device's time line. `mark()` is cheap inside a step (a CUDA event recorded on
    the current stream; a number elsewhere); `seconds(a, b)` reads the time between two marks, on
    CUDA after waiting for `b` only (call it after the step's sync and it waits for nothing).

    Off CUDA the base is this thread's CPU time, or with `wall=True` the host's clock (for pieces
    with no communication inside, whose wall time is their compute: pipeline stages). A `throttle`
    (an emulated device) adds the compute it charged, slept or still owed; with the wall base its
    sleeps are taken out of the wall time so nothing counts twice, and so is the host's lateness
    waking from them (on a busy host, milliseconds a sleep): the device's time is what it charged,
    not when this process next got a core."""

    def __init__(self, device: torch.device, *, throttle=None, wall: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.throttle = throttle
        self.wall = wall

    def mark(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        t = self.throttle
        base = host() if self.wall else thread_cpu()
        if t is None:
            return base
        return base + t.charged_s - (t.slept_seconds + t.overslept_s if self.wall else 0.0)

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def host_part(self) -> float:
        """The host-side clock this device books compute by (before any throttle): this thread's
        CPU time off CUDA (the emulated throttle charges it), the host's clock on CUDA."""
        return host() if self.cuda or self.wall else thread_cpu()
