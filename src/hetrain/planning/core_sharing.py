"""Emulated devices sharing the host's CPU cores (pure; no torch): the rate a computing process
gets, and how much longer an emulated pipeline's step runs for it.

The rate. With k processes computing on `cores` cores beside `load` other always-runnable
processes, each gets min(1, cores / (k + load)) of a core (processor sharing), and the
min(k, cores) that run at once slow each other on shared cache and memory bandwidth by
1 + (contention − 1)·(min(k, cores) − 1)/(contention_at − 1), `contention` being what the job
measured with `contention_at` computing at once (runtime/measure/measurements.contention). The
data-parallel cost model plays a step out with this rate (cost.shared_cpu_finish).

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
from dataclasses import replace




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


def on_shared_cores(c, o, pipeline=None):
    """A pipeline candidate (parallelism.Candidate) of emulated devices under PlanOptions `o`, with
    the host's cores shared: the step played out (`stretched_step`) with what `pipeline` (the
    PipelineProfile) measured of this host's stages (contention, a message's time), else the
    contention the data-parallel probe measured. Unchanged off emulation (`host_cores` None), for
    data parallelism (cost.py plays its step out), when it does not fit, and on the controlled
    clock (a stage's piece then lasts its clocked length, its waits for a core inside the sleep:
    runtime/parallel/pipeline_stage.py)."""
    if o.host_cores is None or o.clocked or c.kind == "dp" or not c.fits or c.split is None:
        return c
    alone = c.split.step_seconds + c.sync_s
    step, stretch = stretched_step(c.split.replicas, c.sync_s, cores=o.host_cores, load=o.host_load,
                                   **sharing(pipeline, o.contention, o.contention_at))
    if not step > alone * (1 + 1e-9):
        return c
    shown = "/".join(f"{k:.2f}" for k in stretch)
    return replace(c, samples_per_s=c.samples_per_s * alone / step,
                   detail=f"{c.detail}; {len(stretch)} emulated stages share {o.host_cores:g} CPU cores: "
                          f"their pieces last x{shown} (step x{(step - c.sync_s) / max(c.split.step_seconds, 1e-12):.2f})")


def sharing(pipeline, contention: float = 1.0, contention_at: int = 1) -> dict:
    """stretched_step's host facts: those the pipeline probe measured (PipelineProfile), else the
    given contention and no message time."""
    if pipeline is not None and (pipeline.contention_at > 1 or pipeline.message_s > 0):
        return dict(contention=pipeline.contention, contention_at=pipeline.contention_at,
                    message_s=pipeline.message_s, busy_message_s=pipeline.busy_message_s,
                    overhead_s=pipeline.piece_overhead_s)
    return dict(contention=contention, contention_at=contention_at)
