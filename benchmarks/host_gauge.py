"""The host's speed as emulated devices find it, read between a plan and its runs.

A wall-clock prediction rests on probes taken at the start of a job; the run it is checked
against comes minutes later. On a virtual host the CPU's speed moves between the two, and not
only for one process alone: on a 2-core AMD EPYC VM a capacity run's CPU a step came out 1.23x
what its plan's profile said (the plan's probes had measured two devices computing at once
1.02-1.07x slower than one), while one process alone, timed by the driver after the plan and
around the run, read the host within 0.4% both times. So the gauge does what the devices do:
`procs` processes, each one thread, started together, each timing
the benchmark model's forward and backward on a fixed batch (the median of RUNS, after a warm-up;
thread CPU time, as the emulator's throttle counts it). A reading is the median over the
processes. The processes live as long as the gauge, so a reading costs well under a second.

The reading is never given to a prediction: layout_accuracy.py shows, for each run, how far the
host was from where it stood at the end of the plan's probes, and with --max-host-move repeats a
run whose host had moved.

Readings before and after a run miss what happens during it. On the same host the host slows in
bursts of a second or two: a third process timing a forward and backward of 4 samples every 0.25 s
beside a DP run read 38-43 ms where it read 23-25 before, and it read so in the very steps in which
the run's ranks took 141-160 ms of CPU instead of 95-127. In runs without such bursts, it stayed at
22-29 ms throughout. So `watch()` keeps one gauge process timing a pass of WATCH_SIZE samples every
WATCH_PERIOD_S while a run trains (about 5% of one core), and `burst_share` says what share of
those passes were BURST_OVER or more slower than the run's fastest quarter: the share of the run
during which the host itself was slow, whatever the run was doing. It does not account for most
of the wall-clock error (docs/planning.md): over 36 rounds the error correlated 0.30 with it.
Plans are not watched: their probes compute flat out on both cores, so a third process would
slow the very probes it watches (beside `hetrain plan`, 36-45% of its passes read slow: the
probes' load, not the host's).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

SIZE = 16      # samples of the fixed batch
RUNS = 7       # forward+backward passes timed a reading (after one warm-up)
WATCH_SIZE = 2           # samples of a pass timed while a run trains: light beside it
WATCH_PERIOD_S = 0.25    # one such pass every this many seconds
BURST_OVER = 1.25        # a watched pass this much slower than the run's fastest quarter: a burst


def burst_share(passes_ms: list[float], over: float = BURST_OVER) -> float | None:
    """The share of a run's watched passes that took `over` times the run's lower quartile or
    longer: how much of the run the host itself was slow. None with fewer than 4 passes. Against
    the run's own fastest quarter, not against a reading taken elsewhere: a pass is slower on an
    idle host (its cores wake from sleep) than beside a run, so only passes of the same run compare."""
    if len(passes_ms) < 4:
        return None
    quick = statistics.quantiles(passes_ms, n=4)[0]
    return sum(v >= over * quick for v in passes_ms) / len(passes_ms)


def _pass(model, x, y, precision: str) -> float:
    """Thread CPU seconds of one forward and backward (layout_accuracy.forward_backward)."""
    from layout_accuracy import forward_backward

    c0 = time.thread_time()
    forward_backward(model, x, y, precision)
    return time.thread_time() - c0


def _serve(model_spec: str, model_env: str, requests, replies, together, stop) -> None:
    """One gauge process: builds the model once, then serves requests until None: ("read",
    precision) times a reading, starting with its peers ("paced": idling after each pass as long as
it took); ("watch", precision) times a small pass
    every WATCH_PERIOD_S until `stop` is set, and replies with their milliseconds."""
    os.environ[model_env] = model_spec
    import torch

    from layout_accuracy import factory

    torch.set_num_threads(1)                 # as an emulated device computes
    model, _, data = factory()
    while (request := requests.get()) is not None:
        kind, precision = request
        if kind == "watch":
            x, y = data[:WATCH_SIZE]
            _pass(model, x, y, precision)         # warm-up
            passes = []
            while not stop.is_set():
                t0 = time.perf_counter()
                passes.append(_pass(model, x, y, precision) * 1000)
                stop.wait(max(0.0, WATCH_PERIOD_S - (time.perf_counter() - t0)))
            replies.put(passes)
            continue
        x, y = data[:SIZE]
        together.wait()
        times = []
        for _ in range(RUNS + 1):
            times.append(_pass(model, x, y, precision))
            if kind == "paced":         # idle as long as it computed, as a device dilated 2x does
                time.sleep(times[-1])
        replies.put(statistics.median(times[1:]))       # after a warm-up


class HostGauge:
    """`procs` gauge processes of the benchmark model `model_spec` (layout_accuracy.MODEL_ENV's
    "layers,d_model,seq_len"). read(precision): CPU seconds of one forward+backward, all at once."""

    def __init__(self, model_spec: str, model_env: str, *, procs: int = 2):
        ctx = mp.get_context("spawn")
        self._requests = [ctx.Queue() for _ in range(procs)]
        self._replies = ctx.Queue()
        self._together = ctx.Barrier(procs)      # kept: the children unpickle it after start()
        self._stop = ctx.Event()
        self._procs = [ctx.Process(target=_serve, args=(model_spec, model_env, q, self._replies, self._together,
                                                        self._stop), daemon=True) for q in self._requests]
        for p in self._procs:
            p.start()

    def read(self, precision: str, *, paced: bool = False) -> float:
        """CPU seconds of one forward+backward, the median over the processes. paced: each pass
        followed by as long idle, as an emulated device computes (the plan's profiles compute flat
        out): how much a pass costs more when the cores have idled before it."""
        for q in self._requests:
            q.put(("paced" if paced else "read", precision))
        return statistics.median(self._replies.get(timeout=300) for _ in self._procs)

    def watch(self) -> None:
        """Start timing a small pass every WATCH_PERIOD_S in one gauge process (until watched()).
        In fp32 whatever the run computes in: it looks for the host's bursts, which slow every
        precision, and fp32 is quick on every host (bf16 is not, on an AVX2-only one)."""
        self._stop.clear()
        self._requests[0].put(("watch", "fp32"))

    def watched(self) -> list[float]:
        """Stop watching; the milliseconds of every pass timed since watch()."""
        self._stop.set()
        return self._replies.get(timeout=300)

    def close(self) -> None:
        for q in self._requests:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
