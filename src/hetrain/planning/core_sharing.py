"""Emulated devices sharing the host's CPU cores (pure; no torch): the rate a computing process
gets, and how much longer an emulated pipeline's stages run for it.

The rate. With k processes computing on `cores` cores beside `load` other always-runnable
processes, each gets min(1, cores / (k + load)) of a core (processor sharing), and the
min(k, cores) that run at once slow each other on shared cache and memory bandwidth by
1 + (contention − 1)·(min(k, cores) − 1)/(contention_at − 1), `contention` being what the job
measured with `contention_at` computing at once (runtime/measure/measurements.contention). The
data-parallel cost model plays a step out with this rate (cost.shared_cpu_finish).

Pipelines. An emulated stage is throttled by the wall time of each piece it computes
(runtime/parallel/pipeline_stage.py: a piece of wall time w is followed by a sleep of w·(1/v − 1)
at speed v), so a piece that waits for a core, or computes beside others, stretches the stage's
whole time by the same factor. Stage p of a pipeline that steps every T seconds, running m
micro-batches of t_p seconds each (emulated: compute at speed v_p and the sleep), wants a core
for u_p = m·t_p·v_p / T of the step. Taking the other processes to want one independently, each
with its own u_q, p's pieces last E[1 / rate(1 + J_p)] times longer, J_p the number of others
computing (a Poisson-binomial count over the u_q). That stretches t_p, which lengthens T and
changes every u: `stretched_step` iterates the three to a fixed point (a few rounds: a stretch
that lengthens T lowers the duties that caused it).

Independence is the approximation, and it under-counts: a stage starts a piece as soon as its
input arrives, so the stages of one replica often start computing together, and replicas that
step together do too. Timed piece by piece on a 2-core AMD EPYC VM (DP×PP 2×2 in fp32,
`benchmarks/plan_accuracy.py --layout dp-pp --dilate 2`), the four stages' pieces lasted
x1.29-1.40 their CPU time where this model gives up to x1.16. It is still what the pipeline model
lacked: without it the same benchmark read DP×PP 29-46% faster than it ran (four emulated devices
wanting 1.3 cores on average).

Cost: O(W²) per round for W processes (each process's count distribution over the others); only
emulated clusters, whose processes are threads of one host, reach it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .stage_plan import fill_drain_seconds

_ROUNDS = 30
_TOLERANCE = 1e-6


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


def computing_stretch(duty: Sequence[float], *, cores: float, load: float = 0.0, contention: float = 1.0,
                      contention_at: int = 1) -> tuple[float, ...]:
    """For each process, how much longer its computing lasts than alone: E[1/rate] over how many
    of the others compute beside it, each a fraction `duty[q]` of the time, independently."""
    u = [min(1.0, max(0.0, d)) for d in duty]
    slower = [1.0 / cpu_rate(1 + j, cores=cores, load=load, contention=contention, contention_at=contention_at)
              for j in range(len(u))]
    out = []
    for p in range(len(u)):
        count = [1.0]                        # P(j others computing), over the others so far
        for q, uq in enumerate(u):
            if q == p:
                continue
            nxt = [0.0] * (len(count) + 1)
            for j, pj in enumerate(count):
                nxt[j] += pj * (1.0 - uq)
                nxt[j + 1] += pj * uq
            count = nxt
        out.append(sum(pj * slower[j] for j, pj in enumerate(count)))
    return tuple(out)


def stretched_step(replicas: Sequence, sync_s: float = 0.0, *, cores: float, load: float = 0.0,
                   contention: float = 1.0, contention_at: int = 1) -> tuple[float, tuple[float, ...]]:
    """(step seconds, each stage's stretch in replica-major order) of emulated pipelines
    (planning.stage_plan.PipelineSplit: each stage's seconds_per_micro at its speed, its
    micro-batches) that share `cores`, plus `sync_s` of the replicas' gradient all-reduce."""
    stages = [(split.micro_batches, s.seconds_per_micro, s.speed) for split in replicas for s in split.stages]
    stretch = [1.0] * len(stages)

    def step() -> float:
        at, longest = 0, 0.0
        for split in replicas:
            t = [s.seconds_per_micro * stretch[at + i] for i, s in enumerate(split.stages)]
            longest = max(longest, fill_drain_seconds(t, split.micro_batches))
            at += len(t)
        return longest + sync_s

    seconds = step()
    for _ in range(_ROUNDS):
        if seconds <= 0:
            break
        duty = [m * t * k * v / seconds for (m, t, v), k in zip(stages, stretch)]
        stretch = list(computing_stretch(duty, cores=cores, load=load, contention=contention,
                                         contention_at=contention_at))
        now = step()
        done = abs(now - seconds) <= _TOLERANCE * seconds
        seconds = now
        if done:
            break
    return seconds, tuple(stretch)


def on_shared_cores(c, o):
    """A pipeline candidate (parallelism.Candidate) of emulated devices under PlanOptions `o`, with
    the host's cores shared: each stage's pieces stretched by the others computing beside it.
    Unchanged off emulation (`host_cores` None), for data parallelism (cost.py plays its step
    out), when it does not fit, and on the controlled clock (a stage's piece then lasts its clocked
    length, its waits for a core inside the sleep: runtime/parallel/pipeline_stage.py)."""
    if o.host_cores is None or o.clocked or c.kind == "dp" or not c.fits or c.split is None:
        return c
    alone = c.split.step_seconds + c.sync_s
    step, stretch = stretched_step(c.split.replicas, c.sync_s, cores=o.host_cores, load=o.host_load,
                                   contention=o.contention, contention_at=o.contention_at)
    if not step > alone * (1 + 1e-9):
        return c
    shown = "/".join(f"{k:.2f}" for k in stretch)
    return replace(c, samples_per_s=c.samples_per_s * alone / step,
                   detail=f"{c.detail}; {len(stretch)} emulated stages share {o.host_cores:g} CPU cores: "
                          f"their pieces last x{shown} (contention x{o.contention:.2f} measured)")
