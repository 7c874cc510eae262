"""Every time read in runtime/ goes through here (tests/unit/test_structure_clocks.py keeps it so).

Three kinds of time, never mixed up:

  wall(), wall_ns()   the calendar: what a record, a lock or a saved file is stamped with
  host()              the host's monotonic clock: timeouts, waits, a step's period between two
                      agreements, a link's schedule. It measures no device work.
  thread_cpu()        this thread's CPU time: the compute of a device that computes on this thread
  DeviceClock         a device's own time, for pieces of its work (forward, backward, optimizer)

A device's work may complete after the host call that launched it returns: a CUDA kernel does, so
`host()` around device work measures the launch, not the compute; anything that reads device data
inside (`.item()`, `int(t)`, a boolean mask) adds all the work queued before it. A `DeviceClock`
therefore marks CUDA work with events (recorded in the step, read after the step's sync: no
synchronisation added), and a CPU device with this thread's CPU time (a wait for peers is not
compute). A device whose time runs beyond what the host's clocks hold answers `ahead_s()` (its
subclass adds it to every mark), and one whose queued work the host must wait for registers
itself with `owe()`: its wait is paid at the sync points, `synchronize()` and `sync_point()`,
which every collective hetrain issues in a step calls first. A timing path that reads `host()`
around such a device's work then misses the device's time, as it would on CUDA.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a device is timed, not here: the launcher's lock and fault files are
# stamped through wall() in processes that never load torch.
_pending: weakref.WeakSet = weakref.WeakSet()   # this process's devices that owe work to a sync point


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


def owe(queue) -> None:
    """A device queue of this process whose work completes after the host call returns: its
    `sync()`, which waits for that work, runs at every sync point."""
    _pending.add(queue)


def sync_point() -> None:
    """Where the host waits for a device's queued work: before a collective, a copy to the host,
    a synchronize. Every queue registered with `owe()` syncs (no-op where none is, and on CUDA,
    whose collectives order themselves on the stream)."""
    for queue in list(_pending):
        queue.sync()


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the device's queued work: CUDA's stream, and the queues registered with `owe()`."""
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
    with no communication inside, whose wall time is their compute: pipeline stages), plus
    `ahead_s()`: the device's time that the base does not hold. That is 0 here, where the device's
    work is this thread's; a device whose work runs beyond the thread answers it (its subclass),
    and with the wall base leaves out what the host already waited for it, so nothing counts twice."""

    def __init__(self, device: torch.device, *, wall: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.wall = wall

    def ahead_s(self) -> float:
        """Device seconds beyond this clock's base (0: the device's work is the base's)."""
        return 0.0

    def waited_s(self) -> float:
        """Seconds the host has spent so far waiting for this device's queued work outside the
        device's own calls (0: the host never waits for it apart from its collectives)."""
        return 0.0

    def mark(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return (host() if self.wall else thread_cpu()) + self.ahead_s()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def host_part(self) -> float:
        """The host-side clock this device books compute by (`ahead_s()` left out): this thread's
        CPU time off CUDA, the host's clock on CUDA."""
        return host() if self.cuda or self.wall else thread_cpu()
