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
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import time

SIZE = 16      # samples of the fixed batch
RUNS = 7       # forward+backward passes timed a reading (after one warm-up)


def _serve(model_spec: str, model_env: str, requests, replies, together) -> None:
    """One gauge process: builds the model once, then times a reading per request (a precision;
    None ends it), starting with its peers."""
    os.environ[model_env] = model_spec
    import torch

    from layout_accuracy import factory, loss_fn

    torch.set_num_threads(1)                 # as an emulated device computes
    model, _, data = factory()
    x, y = data[:SIZE]
    while (precision := requests.get()) is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        together.wait()
        times = []
        for k in range(RUNS + 1):
            c0 = time.thread_time()
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss = loss_fn(model(x), y)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if k:
                times.append(time.thread_time() - c0)
        replies.put(statistics.median(times))


class HostGauge:
    """`procs` gauge processes of the benchmark model `model_spec` (layout_accuracy.MODEL_ENV's
    "layers,d_model,seq_len"). read(precision): CPU seconds of one forward+backward, all at once."""

    def __init__(self, model_spec: str, model_env: str, *, procs: int = 2):
        ctx = mp.get_context("spawn")
        self._requests = [ctx.Queue() for _ in range(procs)]
        self._replies = ctx.Queue()
        self._together = ctx.Barrier(procs)      # kept: the children unpickle it after start()
        self._procs = [ctx.Process(target=_serve, args=(model_spec, model_env, q, self._replies, self._together),
                                   daemon=True) for q in self._requests]
        for p in self._procs:
            p.start()

    def read(self, precision: str) -> float:
        for q in self._requests:
            q.put(precision)
        return statistics.median(self._replies.get(timeout=300) for _ in self._procs)

    def close(self) -> None:
        for q in self._requests:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
