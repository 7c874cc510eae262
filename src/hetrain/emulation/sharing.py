"""Emulated devices sharing the host's CPU cores (pure; no torch): the rate a computing process
gets, a data-parallel step and an emulated pipeline's step played out on the shared cores, and
`SharedHost`, what the emulator hands the planner with the profiles it measures
(DeviceProfile.host): the cost model (planning/cost.py) and the layout ranking call its methods
and never learn what it models. Devices with no host compute independently, as GPUs do.

Data parallelism (`SharedHost.play`, `shared_cpu_finish`):

Stragglers: every step waits for its last device, and which device is last changes from step to
step (on a shared host, whichever process the scheduler left behind), so the step is longer than
the slowest device's average. A job measures this at its start: all ranks run the same backward
at once, and `straggle` is how far the last one trails their average. That probe runs every
device flat out (contention `straggle_stretch`); a step whose devices sleep part of the time
contends less, and trails in proportion to its own stretch beyond 1 (`straggle_at`). The trail
comes from the CPU's jitter, so it is a fraction of the compute that the CPU times: all of it on a
GPU or an emulated device on the CPU's own clock (its compute is its CPU time ÷ its speed), but on
the controlled clock (`clocked`: a micro-batch lasts m·T/speed, the sleep making up what the CPU
did not take) only the last backward, which runs after the step's sleep: its CPU time, about 2/3
of its micro-batch's. Charged on the whole step there, it read the capped 1 : 0.35 pair of
benchmarks/accuracy.py (now its dp-capped row) 3-8% slower than it ran, round after round.

Emulated devices share the host's CPU cores: a device of speed s computes on the CPU for a
fraction s of its busy time and sleeps the rest, so when more devices (with whatever else the host
runs) want a core than there are cores, their compute stretches. `shared_cpu_finish` plays a step
out as the emulator runs it — every device starts together after the previous step's sync, and
computes its step, sleeping once before its last backward — with the cores shared equally among the processes
that want one (processor sharing); the planner plans with the resulting per-device slowdowns.
Devices computing at the same time on separate cores also slow each other (shared cache and
memory bandwidth: one thread's fp32 forward+backward of the demo GPT took 148 ms alone and 157-170 ms
beside a second one, on a 2-core host that was also running a benchmark). A job measures this at its start (`contention`: how much slower every device
computed in the sync probe through the bare module, all at once on `contention_at` cores, than its
profile says), and a
step's CPU segments run slower by the same measure scaled to how many compute at a time.

An emulated step's last micro-batch also costs CPU its profile's flat-out passes do not: the
throttle's sleep before its backward leaves that backward on cold caches (the profile's
`paced_cost`, measured by the profiler), and DDP's hooks and bucket copies run on the thread that
is the emulated GPU (`ddp_cost`, the CPU of the sync probe's DDP runs over its bare ones). Both
are device time the throttle charges, once a step, so `last_micro_extra` adds (paced_cost ·
ddp_cost − 1) of the last micro-batch to the device's compute (on a GPU both are 1: nothing
added). Both are ratios measured at one size (`paced_cost` with one pass's sleep before its
backward, where a step's sleep covers the whole step) and charged in proportion to the last
micro-batch: a cache refilled after a sleep may cost more like a fixed amount than a share, which
these figures cannot tell apart at the sizes measured.

The rate. With k processes computing on `cores` cores beside `load` other always-runnable
processes, each gets min(1, cores / (k + load)) of a core (processor sharing), and the
min(k, cores) that run at once slow each other on shared cache and memory bandwidth by
1 + (contention − 1)·(min(k, cores) − 1)/(contention_at − 1), `contention` being what the job
measured with `contention_at` computing at once (measuring.contention). The
data-parallel step is played out with this rate (`shared_cpu_finish`).

Pipelines (`stretched_step`) are played out too, piece by piece. An emulated stage is throttled
by the wall time of each piece it computes (runtime/parallel/pipeline_stage.py: a piece of wall
time w is followed by a sleep of w·(1/v − 1) at speed v, and its output is sent after that
sleep), so a piece that waits for a core, or computes beside others, stretches the stage by the
same factor. Every replica's stages run their schedule's order (1F1B: p − s forwards, then a
backward and a forward in turn, then the backwards left; GPipe: every forward, then every
backward), a forward after the previous stage's forward of that micro-batch, a backward after
the next stage's backward; a forward is a third of the stage's micro-batch, a backward two
thirds (as the controlled clock cuts them). The computing pieces share the cores at `cpu_rate`
from one event to the next. All replicas start together, as they do after each step's gradient
all-reduce, and the step is the last piece's end.

Why not a duty-cycle average: the first version took each stage to compute a fraction u of
the step independently of the others (a Poisson-binomial count of who computes beside it). The
stages of a replica, and the replicas, start pieces together, so that under-counted: on a
2-core AMD EPYC VM, DP×PP 2×2 (`benchmarks/accuracy.py --layouts dp-pp --clock wall`, wall
clock) the pieces lasted x1.22-1.24 their CPU time where it gave x1.13-1.16, and the row read
32% fast. The played-out step keeps the formula's step (stage_plan.fill_drain_seconds) as its
base and scales it by the ratio of the step played out on the shared cores to the same step
played out alone, so where nothing is shared nothing changes.

Cost: O(E·W) for E = 2·n·W pieces of W processes (n micro-batches); only emulated clusters,
whose processes are threads of one host, reach it."""

from __future__ import annotations

from collections.abc import Sequence
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..planning.cost import Assignment
    from ..planning.profile import DeviceProfile


def cpu_rate(running: int, *, cores: float, load: float = 0.0, contention: float = 1.0,
             contention_at: int = 1) -> float:
    """The share of a core each of `running` computing processes gets (1.0: as fast as alone)."""
    if running < 1:
        return 1.0
    rate = min(1.0, cores / (running + load))
    at_once = min(running, cores)
    if contention > 1.0 and contention_at > 1 and at_once > 1:
        rate /= 1.0 + (contention - 1.0) * min(1.0, (at_once - 1) / (contention_at - 1))
    return rate


def _order(schedule: str, stage: int, stages: int, n: int) -> list[tuple[str, int]]:
    """The pieces stage `stage` runs, in its schedule's order (torch.distributed.pipelining)."""
    if schedule == "gpipe":
        return [("F", k) for k in range(n)] + [("B", k) for k in range(n)]
    warm = min(n, stages - stage)
    out = [("F", k) for k in range(warm)]
    f = warm
    for k in range(n):
        out.append(("B", k))
        if f < n:
            out.append(("F", f))
            f += 1
    return out


def play_step(replicas: Sequence, *, cores: float | None, load: float = 0.0, contention: float = 1.0,
              contention_at: int = 1, message_s: float = 0.0, busy_message_s: float | None = None,
              overhead_s: float = 0.0) -> tuple[float, tuple[float, ...]]:
    """(seconds, each stage's mean piece wall time over its CPU time, replica-major) of one step of
    emulated pipelines (planning.stage_plan.PipelineSplit each) played out on `cores` shared cores
    (None: a core each, nothing shared). A piece's output reaches the next stage `message_s` after
    it is sent, `busy_message_s` (default the same) when every core is computing at that moment.
    Each piece is preceded by `overhead_s` of the schedule's own CPU, which no throttle stretches."""
    busy_message_s = message_s if busy_message_s is None else busy_message_s
    procs = []   # per stage: (speed, CPU seconds of a forward and a backward, its pieces, replica, stage, p)
    for r, split in enumerate(replicas):
        p = len(split.stages)
        for s, st in enumerate(split.stages):
            cpu = st.seconds_per_micro * st.speed
            procs.append((st.speed, {"F": cpu / 3, "B": 2 * cpu / 3}, _order(split.schedule, s, p, split.micro_batches),
                          r, s, p))
    w = len(procs)
    index = {(pr[3], pr[4]): i for i, pr in enumerate(procs)}
    arrived: dict[tuple[int, str, int], float] = {}     # (process, F|B, micro-batch) -> when its output arrives
    sending: list[tuple[float, int, str, int]] = []     # outputs sent after their throttle's sleep, not yet arrived
    at = [0] * w                                        # next piece of each process
    free = [0.0] * w                                    # when each process may start its next piece
    left = [0.0] * w                                    # CPU seconds left of the piece it computes
    began = [0.0] * w
    computing = [False] * w
    wall = [0.0] * w
    cpu_total = [0.0] * w
    end = now = 0.0

    def ready(i: int) -> float | None:
        """When process i's next piece may start (None: it waits for an output not yet arrived)."""
        if at[i] >= len(procs[i][2]) or computing[i]:
            return None
        kind, k = procs[i][2][at[i]]
        r, s, p = procs[i][3], procs[i][4], procs[i][5]
        if kind == "F" and s > 0:
            dep = arrived.get((index[(r, s - 1)], "F", k))
        elif kind == "B" and s < p - 1:
            dep = arrived.get((index[(r, s + 1)], "B", k))
        else:
            dep = 0.0
        return None if dep is None else max(dep, free[i])

    while True:
        for i in range(w):
            t = ready(i)
            if t is not None and t <= now:
                computing[i], left[i], began[i] = True, procs[i][1][procs[i][2][at[i]][0]] + overhead_s, now
        running = [i for i in range(w) if computing[i]]
        rate = 1.0 if cores is None else cpu_rate(len(running), cores=cores, load=load, contention=contention,
                                                  contention_at=contention_at)
        events = [now + left[i] / rate for i in running] + [t for t, *_ in sending]
        events += [t for i in range(w) if (t := ready(i)) is not None and t > now]
        if not events:
            break
        nxt = min(events)
        for i in running:
            left[i] -= (nxt - now) * rate
        now = nxt
        for i in running:
            if left[i] <= 1e-12 * max(1.0, now):
                kind, k = procs[i][2][at[i]]
                cpu = procs[i][1][kind]
                spent = (now - began[i]) * cpu / (cpu + overhead_s) if cpu + overhead_s > 0 else 0.0   # the piece's part
                wall[i] += spent
                cpu_total[i] += cpu
                free[i] = now + spent * (1.0 / procs[i][0] - 1.0)      # the throttle's sleep, then the send
                sending.append((free[i], i, kind, k))
                end = max(end, free[i])
                computing[i], at[i] = False, at[i] + 1
        still = []
        full = cores is not None and sum(computing) >= cores
        for t, i, kind, k in sending:
            if t <= now:
                arrived[(i, kind, k)] = t + (busy_message_s if full else message_s)
            else:
                still.append((t, i, kind, k))
        sending = still
    return end, tuple(wl / c if c > 0 else 1.0 for wl, c in zip(wall, cpu_total))


def stretched_step(replicas: Sequence, sync_s: float = 0.0, *, cores: float, load: float = 0.0,
                   contention: float = 1.0, contention_at: int = 1, message_s: float = 0.0,
                   busy_message_s: float | None = None, overhead_s: float = 0.0) -> tuple[float, tuple[float, ...]]:
    """(step seconds, each stage's stretch in replica-major order) of emulated pipelines
    (planning.stage_plan.PipelineSplit: each stage's seconds_per_micro at its speed, its
    micro-batches) that share `cores`, plus `sync_s` of the replicas' gradient all-reduce: the
    formula's step scaled by the step played out shared (with the messages' time) over the step
    played out alone (a core each, messages free)."""
    alone = max(split.step_seconds for split in replicas)
    played_alone, _ = play_step(replicas, cores=None)
    played, stretch = play_step(replicas, cores=cores, load=load, contention=contention, contention_at=contention_at,
                                message_s=message_s, busy_message_s=busy_message_s, overhead_s=overhead_s)
    scale = played / played_alone if played_alone > 0 else 1.0
    return alone * max(1.0, scale) + sync_s, stretch


def sharing(pipeline, contention: float = 1.0, contention_at: int = 1) -> dict:
    """stretched_step's host facts: those the pipeline probe measured (PipelineProfile.host,
    emulation/pipeline.py), else the given contention and no message time."""
    if pipeline is not None:
        host = host_figures(pipeline.host)
        if host["contention_at"] > 1 or host["message_s"] > 0:
            return dict(contention=host["contention"], contention_at=host["contention_at"],
                        message_s=host["message_s"], busy_message_s=host["busy_message_s"],
                        overhead_s=host["piece_overhead_s"])
    return dict(contention=contention, contention_at=contention_at)


HOST_DEFAULTS = {"contention": 1.0, "contention_at": 1, "message_s": 0.0, "busy_message_s": 0.0,
                 "piece_overhead_s": 0.0}


def host_figures(host: dict | None) -> dict:
    """The pipeline probe's host figures (PipelineProfile.host, measured by pipeline.py), checked,
    with what was not measured at its default (no contention, messages free)."""
    from ..errors import UsageError

    got = {**HOST_DEFAULTS, **(host or {})}
    if not (1.0 <= got["contention"] <= 2.0) or got["contention_at"] < 1:
        raise UsageError(f"contention={got['contention']!r} at {got['contention_at']!r} computing at once",
                         "measure the pipeline again, or give a contention in [1, 2] at 1 or more at once")
    return got


def straggle_at(straggle: float, measured_stretch: float, stretch: float) -> float:
    """The straggle of a step with contention `stretch`, from one measured at `measured_stretch`
    (as a fraction of the step's compute). Measured without contention: as measured."""
    if measured_stretch <= 1.0:
        return straggle
    return straggle * min(1.0, max(0.0, (stretch - 1.0) / (measured_stretch - 1.0)))


# -- emulated devices sharing the host's cores ------------------------------------------------


def _cpu_then_sleep(p: DeviceProfile, device_s: float) -> list[tuple[bool, float]]:
    """A piece of device time as the emulator runs it: CPU (a share s of it), then the sleep."""
    cpu = device_s * p.cpu_share
    return [(True, cpu), (False, device_s - cpu)]


def _compute_segments(a: Assignment, ddp_cost: float = 1.0) -> list[tuple[bool, float]]:
    """This device's step as the emulator runs it (device.py's Throttle: one sleep, for the whole
    step's compute, before the last micro-batch's backward): the earlier micro-batches and the last
    forward on the CPU, the sleep, the last backward on the CPU (with the last micro-batch's extra,
    `last_micro_extra`: the throttle books it after that backward, and its sleep is paid in the
    next step's). Segments are (on_cpu, seconds of CPU work or of sleep)."""
    p, extra = a.profile, a.last_micro_extra(ddp_cost)
    dev = sum(p.micro_seconds(m, **a.ckpt) for m in a.micro_sizes) + extra
    last_cpu = p.micro_seconds(a.micro_sizes[-1], **a.ckpt) * p.cpu_share
    cpu = dev * p.cpu_share
    before = cpu - last_cpu * (1 - p.forward_fraction) - extra * p.cpu_share
    return [(True, before), (False, dev - cpu), (True, cpu - before)]


def shared_cpu_finish(jobs: Sequence[Sequence[tuple[bool, float]]], cores: float,
                      load: float = 0.0, *, contention: float = 1.0, contention_at: int = 1) -> list[float]:
    """When each job finishes, all starting at 0, if every job's CPU segments share `cores` with
    `load` other always-runnable processes (processor sharing: each running process gets
    min(1, cores / runnable) of a core) and its sleep segments take their own time. A fluid
    simulation: between events the rates are constant.

    `contention`: how much slower a job computes while `contention_at` jobs compute on separate
    cores (measured); k jobs at once slow each other by 1 + (contention − 1)·(k − 1)/(contention_at − 1),
    nothing when one computes alone (cpu_rate, which pipelines use too)."""
    queue = [[(cpu, d) for cpu, d in job if d > 1e-12] for job in jobs]
    pos = [0] * len(queue)
    left = [q[0][1] if q else 0.0 for q in queue]
    finish = [0.0 if not q else math.nan for q in queue]
    t = 0.0
    while True:
        live = [j for j, q in enumerate(queue) if pos[j] < len(q)]
        if not live:
            return finish
        running = [j for j in live if queue[j][pos[j]][0]]
        rate = cpu_rate(len(running), cores=cores, load=load, contention=contention, contention_at=contention_at)
        dt = min(left[j] / (rate if queue[j][pos[j]][0] else 1.0) for j in live)
        t += dt
        for j in live:
            left[j] -= dt * (rate if queue[j][pos[j]][0] else 1.0)
            if left[j] <= 1e-12:
                pos[j] += 1
                if pos[j] < len(queue[j]):
                    left[j] = queue[j][pos[j]][1]
                else:
                    finish[j] = t


@dataclass(frozen=True, kw_only=True)
class SharedHost:
    """What the planner must know of emulated devices that are processes of one host (the module
    docstring), carried by their profiles (DeviceProfile.host) and made by the runtime from what a
    job measured at its start (runtime/measure/measurements.py). `cores` None: a core each (a
    host only for its stragglers)."""

    cores: float | None = None        # cores shared by devices with cpu_share > 0
    load: float = 0.0                 # other runnable processes on those cores (measured or 0)
    contention: float = 1.0           # devices computing at once slow each other by this (measured)...
    contention_at: int = 1            # ...with this many computing at once (the probe's)
    ddp_cost: float = 1.0             # a DDP-synced micro-batch's CPU over the bare module's (measured)
    straggle: float = 0.0             # how far the last device trails the average, measured
    straggle_stretch: float = 1.0     # the host-core contention `straggle` was measured under
    clocked: bool = False             # the devices run on the controlled clock (what can trail)

    def __post_init__(self) -> None:
        from ..errors import UsageError

        if not (0 <= self.straggle < 10) or not self.straggle_stretch >= 1:
            raise UsageError(f"straggle {self.straggle!r} at contention {self.straggle_stretch!r}",
                             "give a measured fraction >= 0 and a contention >= 1 (or leave both out)")
        if not (1.0 <= self.contention <= 10.0) or self.contention_at < 1:
            raise UsageError(f"contention {self.contention!r} at {self.contention_at!r} devices",
                             "give a measured slowdown in [1, 10] and a device count >= 1 (or leave both out)")
        if not 1.0 <= self.ddp_cost <= 2.0:
            raise UsageError(f"DDP's cost {self.ddp_cost!r}", "give a measured ratio in [1, 2] (or leave it out)")
        if self.cores is not None and not self.cores > 0:
            raise UsageError(f"host cores {self.cores}", "give the host's core count, or none")
        if not self.load >= 0:
            raise UsageError(f"host load {self.load}", "give the other runnable processes, >= 0")

    @property
    def replan(self) -> bool:
        """Whether a split's slowdowns depend on the split (the planner re-splits by them)."""
        return self.cores is not None

    def play(self, assignments, ddp_cost: float = 1.0) -> tuple[tuple[float, ...], float] | None:
        """(each device's compute, the optimizer phase) of a data-parallel step (planning.cost
        Assignments) played out on the shared cores; None when nothing shares them."""
        if not self.cores or not any(a.profile.cpu_share > 0 for a in assignments):
            return None
        shared = dict(cores=self.cores, load=self.load, contention=self.contention, contention_at=self.contention_at)
        compute = tuple(shared_cpu_finish([_compute_segments(a, ddp_cost) for a in assignments], **shared))
        opt = max(shared_cpu_finish([_cpu_then_sleep(a.profile, a.profile.optimizer_s) for a in assignments],
                                    **shared))
        return compute, opt

    def straggle_s(self, *, window: float, cpu_share: float, compute_s: float, stretch: float) -> float:
        """The step's wait for whichever device is last: the compute the CPU times (on the clock,
        the last backward's CPU: `window` at `cpu_share`; else the slowest device's `compute_s`)
        times the straggle at the step's `stretch`."""
        jitter = window * cpu_share if self.clocked else compute_s
        return jitter * straggle_at(self.straggle, self.straggle_stretch, stretch)

    def pipeline(self, c, pipeline=None):
        """A pipeline candidate (planning.parallelism.Candidate) with the host's cores shared: the
        step played out (`stretched_step`) with what `pipeline` (the PipelineProfile) measured of
        this host's stages (contention, a message's time), else the contention the data-parallel
        probe measured. Unchanged with a core each, for data parallelism (`play`), when it does
        not fit, and on the controlled clock (a stage's piece then lasts its clocked length, its
        waits for a core inside the sleep: runtime/parallel/pipeline_stage.py)."""
        if self.cores is None or self.clocked or c.kind == "dp" or not c.fits or c.split is None:
            return c
        alone = c.split.step_seconds + c.sync_s
        step, stretch = stretched_step(c.split.replicas, c.sync_s, cores=self.cores, load=self.load,
                                       **sharing(pipeline, self.contention, self.contention_at))
        if not step > alone * (1 + 1e-9):
            return c
        shown = "/".join(f"{k:.2f}" for k in stretch)
        return replace(c, samples_per_s=c.samples_per_s * alone / step,
                       detail=f"{c.detail}; {len(stretch)} emulated stages share {self.cores:g} CPU cores: "
                              f"their pieces last x{shown} (step x{(step - c.sync_s) / max(c.split.step_seconds, 1e-12):.2f})")

    def predicted(self, cost) -> dict:
        """The figures a plan keeps of this host (numbers only), beside its planning.cost.StepCost."""
        out: dict[str, float] = {}
        if self.straggle:
            out.update(straggle=self.straggle, straggle_stretch=self.straggle_stretch, straggle_s=cost.straggle_s,
                       clocked=float(self.clocked))    # 1.0 on the controlled clock
        if self.contention > 1.0:
            out.update(contention=self.contention, contention_at=float(self.contention_at))
        if self.ddp_cost > 1.0:
            out["ddp_cost"] = self.ddp_cost
        return out

    def notes(self, cost) -> list[str]:
        """What the plan's note says of this host."""
        if not cost.stretch >= 1.005 or self.cores is None:
            return []
        return [f"emulated devices share {self.cores:g} CPU cores"
                + (f" with ~{self.load:.1f} other busy processes" if self.load else "")
                + f": compute stretched up to ×{cost.stretch:.2f}"
                + (f" (×{self.contention:.2f} measured with {self.contention_at} computing at once: shared cache "
                   "and memory bandwidth)" if self.contention >= 1.005 else "")]
