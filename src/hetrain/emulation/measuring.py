"""What a job's measurements say of emulated devices sharing this host, for the planner: their
profiles pooled (every rank measured the same CPU), and the `SharedHost` (sharing.py) the planning
profiles carry, read off the job's probes (runtime/measure/joint.py gathers them;
runtime/measure/measurements.planning_profiles hands the result to the planner). Pure: no torch,
no processes.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from ..hardware.cluster import parse_cluster
from .sharing import SharedHost

MIN_PROBE_CPU_S = 0.005       # a probe micro-batch shorter than this says nothing about contention or DDP's cost


def planning_profiles(m, config, profiles: tuple, lag: float) -> tuple:
    """The profiles the planner is given (`profiles`: each rank's, `lag`: the stragglers the probe
    measured, measurements.straggle): on an emulated cluster every rank measured the same CPU, so
    the measurements are pooled (less noise than any one rank's). On the controlled clock the
    profiles are what the ranks measured on it (the profiler times a device through its own
    throttle, profiling.py): the planner is not told the clock. Each carries what the devices
    share (DeviceProfile.host, `shared_host`), when they share anything."""
    from .profiling import pool_emulated      # here, not at the top: profiling imports torch

    profiles = list(profiles)
    if config.emulation.cluster and len(profiles) > 1:
        profiles = pool_emulated(profiles, list(parse_cluster(config.emulation.cluster)))
    host = shared_host(m, config, tuple(profiles), lag)
    return tuple(profiles if host is None else (replace(p, host=host) for p in profiles))


def shared_host(m, config, profiles: tuple, lag: float) -> SharedHost | None:
    """What W > 1 ranks' processes share, as the probes measured it: the stragglers (`lag`: the
    probe's last rank over the average); on an emulated cluster also the host's cores (its devices
    are threads of this host: they contend for them, sharing.py), the contention and DDP's CPU.
    Other work on the host is not modelled: it comes and goes faster than a plan lives. None when
    there is nothing to share (one device, or devices that compute apart without trailing)."""
    if m.world_size < 2 or m.profiles is None:
        return None
    if not config.emulation.cluster:
        return SharedHost(straggle=lag) if lag else None
    n = m.world_size              # the probe ran every device at full speed at once
    return SharedHost(cores=m.cpu_cores, straggle=lag, straggle_stretch=max(1.0, n / m.cpu_cores),
                      contention=contention(m, profiles, config), contention_at=min(n, m.cpu_cores),
                      ddp_cost=ddp_cost(m, profiles, config), clocked=config.emulation.sample_s is not None)


def _probe_medians(m, profiles: tuple, config, runs_of) -> list:
    """Each rank's profile and the median of its sync probe runs in `runs_of` (0: untimed), for
    emulated devices on the CPU's own clock and where the probe's micro-batch is long enough to
    time (MIN_PROBE_CPU_S of CPU alone): what `contention` and `ddp_cost` are read from. Empty
    elsewhere (not emulated, the controlled clock, nothing measured)."""
    if not config.emulation.cluster or config.emulation.sample_s is not None or m.probe_size < 1 or not runs_of:
        return []
    out = []
    for p, runs in zip(profiles, runs_of):
        timed = [t for t in runs if t > 0]
        if timed and p.micro_seconds(m.probe_size) * p.cpu_share >= MIN_PROBE_CPU_S:
            out.append((p, statistics.median(timed)))
    return out


def contention(m, profiles: tuple, config) -> float:
    """How much slower emulated devices compute while they all compute at once than their
    profiles say (shared cache and memory bandwidth): in the sync probe every rank runs the same
    micro-batch at the same moment, through the bare module (DDP's own cost is `ddp_cost`'s); the
    median over ranks of (median probe seconds ÷ the profile's CPU seconds for that micro-batch),
    less the core sharing the cost model already plays out (n / cores when more devices than
    cores). 1.0 where not measured, or when the probe's micro-batch is too short to time (under
    5 ms of CPU: a pass's fixed costs, and in older measurements, whose runs went through DDP,
    DDP's and gloo's, would be read as contention). At most 2: what was measured here is
    1.05-1.25. On the controlled clock 1.0 too, as the emulator runs it: a micro-batch's sleep is
    its clocked length less the CPU time it took, so a CPU that contention slows sleeps less and
    the device keeps its time (waits for a core are not CPU time, and the cost model plays those
    out)."""
    timed = _probe_medians(m, profiles, config, m.plain_compute_s or m.compute_s)   # older: no bare runs
    if not timed:
        return 1.0
    ratios = [t / (p.micro_seconds(m.probe_size) * p.cpu_share) for p, t in timed]   # over its CPU alone
    sharing = max(1.0, m.world_size / max(1, m.cpu_cores))
    return min(2.0, max(1.0, statistics.median(ratios) / sharing))


def ddp_cost(m, profiles: tuple, config) -> float:
    """How much more CPU a micro-batch whose gradients DDP syncs takes than the same forward and
    backward through the bare module, on emulated devices on the CPU's own clock: the median over
    ranks of each rank's median ratio of its sync probe runs' CPU time on the backward's thread to
    that of the bare runs beside them (every rank at once in both: the host's contention moves
    both alike). That thread's CPU is what an emulated device is charged as compute, and through
    DDP it also runs DDP's hooks, copies every gradient into its bucket and launches the
    all-reduces (gloo's own threads are not counted: the throttle does not charge them). The DDP
    run is timed to its last bucket's launch, a little short of its backward's end, so this errs
    low. 1.0 where not measured (a GPU: DDP's copies run on the GPU, inside the profile's times;
    older measurements), on the controlled clock (a CPU that works more sleeps less), or when the
    probe's micro-batch is too short to time; at most 1.5."""
    ratios = [r for _, r in _probe_medians(m, profiles, config, m.ddp_over_bare)]
    return min(1.5, max(1.0, statistics.median(ratios))) if ratios else 1.0


def pipeline_on_clock(pipeline, profiles, config):
    """The measured pipeline (planning/ranking.measured_pipeline's pair, or None) as the ranking
    sees it: on the controlled clock a stage's pieces last their blocks' share of the whole
    model's clocked time (`clocked_sample_s`); elsewhere as measured."""
    if pipeline is None or not config.emulation.cluster or config.emulation.sample_s is None:
        return pipeline
    return pipeline[0].on_clock(clocked_sample_s(profiles, pipeline[1])), pipeline[1]


def clocked_sample_s(profiles, devices) -> float:
    """The seconds a sample takes at speed 1 on the controlled clock, as the profiler measured it
    (not the clock's own setting: the ranking is not told it). On the clock a stage's pieces last
    their blocks' share of the whole model's time (PipelineProfile.on_clock), and that whole-model
    time is the fastest device's measured seconds a sample times its speed; the fixed part a
    micro-batch pays comes from the same profile (planning/parallelism.with_fixed_cost)."""
    fastest = min(profiles, key=lambda p: p.per_sample_s)
    return fastest.per_sample_s * max(d.speed for d in devices)


def link_note(config) -> str:
    """What the plan's inter-node link line adds: the emulated link's bandwidth, when it is one."""
    emu = config.emulation
    return f" (emulated: {emu.link_gbs:g} GB/s)" if emu.link_gbs and emu.cluster else ""
