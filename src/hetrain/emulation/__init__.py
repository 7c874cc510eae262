"""The CPU emulator: CPU threads playing GPUs of given speeds and memories, so that a mixed cluster
can be tried, tested and benchmarked on one host. Everything here exists only for emulation; the
rest of hetrain reaches it at two points:

  hooks.make_hooks   a job's device hooks: an emulated device's throttle, memory meter and faults
  sharing.SharedHost what the planner must know of devices that are threads of one host (core
                     sharing, contention, DDP's CPU, the stragglers), carried by the profiles the
                     emulator measures (DeviceProfile.host), never by the planner's options

  device.py       the throttle (CPU time stretched to the device's speed, or the controlled clock),
                  the memory meter, the process a device runs in
  clock.py        an emulated device's clock: its thread's CPU time plus what the throttle charged
  held_memory.py  what the autograd graphs hold, and an OOM's failed graph
  link.py         an emulated inter-node link
  islands.py      each node's --emulate spec joined into the job's at start (engine's join_nodes),
                  and the island and bridge links an island spec names, paced
  pacing.py       what pacing costs a device's CPU (the profile's paced_cost)
  pipeline.py     an emulated device as a pipeline stage asks it (DeviceHooks.stage_hooks): its
                  pieces throttled, its bytes counted, the host its stages share measured
  sharing.py      devices sharing the host's cores: the rate, a step played out (data and pipeline)
  trials.py       a sweep's trial on an emulated device: its process, its compute at speed, a group's launch
  cli.py          the --emulate option the CLI commands declare, and their checks of it
  profiling.py    how an emulated device is measured: its answers to the profiler and the probes
  measuring.py    what a job's measurements say of devices sharing the host (pooled, SharedHost)

The launcher and the tests turn it on with the `Emulation` config group (`hetrain run --emulate`
writes it into the launch file; a test imports it from here): it is not part of hetrain's public
API, since a training script never sets it. Importing this package loads no torch.
"""

from ..runtime.config_groups import Emulation

__all__ = ["Emulation"]
