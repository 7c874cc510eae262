"""An emulated device's clock: busy time, the CPU time its thread computed plus the compute its
throttle charged (device.Throttle), whether or not the throttle has slept it yet.

With HETRAIN_EMULATE_ASYNC=1 an emulated device, like a GPU, pays its sleeps only at the sync
points (runtime/devices/clock.py `synchronize()` and `sync_point()`, which every collective hetrain
issues in a step calls first): its throttle registers with `clock.owe()` and sleeps what it owes
there. Its time is the device's from the moment it is charged, so the clock reads it at once; a
host clock around the op does not, as it does not see a CUDA kernel.
"""

from __future__ import annotations

import torch

from ..runtime.devices.clock import DeviceClock


class EmulatedClock(DeviceClock):
    """A DeviceClock whose device time runs ahead of its base by what the throttle charged: its
    sleeps (slept or still owed) on the CPU-time base; on the wall base, only those not yet slept
    (a sleep already in the wall time is not counted twice)."""

    def __init__(self, device: torch.device, throttle, *, wall: bool = False):
        super().__init__(device, wall=wall)
        self.throttle = throttle

    def ahead_s(self) -> float:
        return self.throttle.ahead_s(self.wall)

    def waited_s(self) -> float:
        """What the throttle slept: the host waiting for the emulated device's compute."""
        return self.throttle.waited_s()
