"""`hetrain sweep --emulate`: a trial on an emulated device. cli/sweep.py gives each emulated slot
`TARGET` as its target; the sweep's workers and group jobs ask it what the trial's process and
its compute are (sweeping/runner.SweepSetup.targets), the way they ask a GPU's CUDA index.

A worker holds one emulated device: one CPU thread, glibc keeping the memory it frees, as a job's
ranks (device.become_emulated_device). A trial's `ctx.compute(samples=n)` runs at the device's
speed: its CPU time c lasts c/speed (a sleep of c·(1/speed − 1)), or on the controlled clock
(`--emulate-sample-s`, benchmarks and tests) n·sample_s/speed whatever the CPU took, the sleep
making up the rest. A group trial is a hetrain job over the group's emulated devices: its launch
file names them (as `hetrain run --emulate` writes it), and hetrain's engine throttles each rank.
Importing this module loads no torch.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class EmulatedTarget:
    """The target of a sweep slot an emulated device holds (picklable: the worker gets it
    with the sweep's setup)."""

    torch_device = "cpu"
    enter_ref = f"{__name__}:enter"       # for a group job's ranks, which read their task from JSON

    def __eq__(self, other) -> bool:
        return isinstance(other, EmulatedTarget)

    def __hash__(self) -> int:
        return hash(EmulatedTarget)

    def enter(self) -> None:
        enter()

    @contextmanager
    def at_speed(self, ctx, samples: int | None = None):
        """A piece of the trial's compute (TrialContext.compute), stretched to the device's speed."""
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t_wall, time.thread_time() - t_cpu
            if ctx.sample_s is not None and samples is not None:
                owed = samples * ctx.sample_s / ctx.speed - wall
            else:
                owed = cpu * (1 / ctx.speed - 1)
            if owed > 0:
                time.sleep(owed)

    def group_launch(self, specs: list[str], *, sample_s: float | None, run_dir: str) -> dict:
        """The launch file of a group job over these emulated devices (their cluster specs)."""
        return {"config": {"emulation": {"cluster": ",".join(specs), "sample_s": sample_s}},
                "defaults": {}, "run_dir": run_dir, "node": {"name": "sweep"}}


def enter() -> None:
    """This process becomes the emulated device (one CPU thread, glibc keeping freed memory)."""
    from .device import become_emulated_device

    become_emulated_device()


TARGET = EmulatedTarget()
