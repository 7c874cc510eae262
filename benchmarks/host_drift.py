"""How steady is this host? The floor under every wall-clock prediction made here.

A plan's prediction comes from a few seconds of probes at the start of a job (runtime/measure/);
a run lasts a minute or more. On a shared or virtual host the CPU's own speed drifts between the
two: a neighbour's load, frequency changes, the hypervisor. No prediction from a short probe can be
closer to the run's average than the host's own drift, so this benchmark measures that drift with
a workload that does not change, counted in windows of --window seconds, first in one process,
then in --procs processes at once (as emulated devices run). The workload is one thread's fp32
512x512 matmuls, or with --model the accuracy benchmarks' own model: its forward and backward on
16 samples, in --precision. The two do not always see the same host: on a 2-core AMD EPYC VM,
20 s of one process alone, the matmuls read a 2-s window within 2.9% of the phase's mean and the
model (bf16), run next, within 10.6%; one thread of the model on 19 samples, nothing else running,
took 84-123 ms a pass from one second to the next. The model's drift is the floor under a
wall-clock prediction of that model, so layout_accuracy.py reads it, the matmuls' beside it.

It reports, for each phase, each window's rate, the spread (slowest window / fastest) and how far
a probe as long as one window would be from the whole phase's mean (the largest and the typical
|window / mean - 1|); and the slowdown of running --procs at once (the contention the cost model
measures at a job's start).

    python benchmarks/host_drift.py --json host_drift.json [--seconds 40 --window 2 --procs 2]
                                   [--model 4,128,64 --precision bf16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch


MODEL_SAMPLES = 16      # --model: the batch each forward+backward runs


def _workload(model: tuple[str, str] | None):
    """One unit of work: a 512x512 fp32 matmul, or (model: its "layers,d_model,seq_len" and a
    precision) one forward and backward of layout_accuracy's model (forward_backward)."""
    if model is None:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        return lambda: a @ b
    import os

    from layout_accuracy import MODEL_ENV, factory, forward_backward

    spec, precision = model
    os.environ[MODEL_ENV] = spec
    net, _, data = factory()
    x, y = data[:MODEL_SAMPLES]
    return lambda: forward_backward(net, x, y, precision)


def rates(seconds: float, window: float, start_at: float, out, model=None) -> None:
    """Units of work per second in each `window` of `seconds`, from the shared start time on."""
    torch.set_num_threads(1)
    work = _workload(model)
    for _ in range(3):
        work()                                  # warm-up: allocation, first-touch
    while time.time() < start_at:
        time.sleep(0.001)
    found, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < window:
            work()
            n += 1
        found.append(n / (time.perf_counter() - t0))
    out.put(found)


def phase(procs: int, seconds: float, window: float, model=None) -> list[list[float]]:
    """Each process's window rates, all processes started together (model: rates())."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + (3.0 if model is None else 6.0)     # for the spawned interpreters' imports
    ps = [ctx.Process(target=rates, args=(seconds, window, start_at, q, model)) for _ in range(procs)]
    for p in ps:
        p.start()
    found = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
    return found


def summary(per_proc: list[list[float]]) -> dict:
    windows = [statistics.mean(w) for w in zip(*per_proc)]    # the processes' mean, window by window
    mean = statistics.mean(windows)
    off = [abs(w / mean - 1) for w in windows]
    return {"windows_per_s": [round(w, 1) for w in windows], "mean_per_s": mean,
            "slowest_over_fastest": min(windows) / max(windows),
            "probe_error_max": max(off), "probe_error_median": statistics.median(off)}


def describe(model) -> str:
    return "fp32 512x512 matmuls" if model is None else \
        f"the model's forward+backward ({model[0]}, {MODEL_SAMPLES} samples, {model[1]})"


def probe_drift(*, seconds: float = 10.0, window: float = 2.0, procs: int = 2, model=None) -> dict:
    """The drift the accuracy benchmarks read their wall-clock errors against: `procs` processes
    at once (as emulated devices run) for `seconds`, how far one `window` (a probe's length) is
    from the whole phase's mean (summary()'s figures, and the settings); the work: rates()."""
    return {**summary(phase(procs, seconds, window, model)), "seconds": seconds, "window_s": window, "procs": procs,
            "workload": describe(model)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    p.add_argument("--window", type=float, default=2.0, help="seconds per window (a probe's length)")
    p.add_argument("--procs", type=int, default=2, help="processes at once in the second phase")
    p.add_argument("--model", default=None,
                   help="instead of matmuls, the accuracy benchmarks' model (layout_accuracy.py's "
                        "layers,d_model,seq_len, e.g. 4,128,64): its forward and backward")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="with --model: the precision it computes in")
    args = p.parse_args(argv)
    if args.seconds < 2 * args.window or args.window <= 0 or args.procs < 1:
        print("host_drift: --seconds must hold at least two --window(s), and --procs must be >= 1; "
              "e.g. --seconds 40 --window 2 --procs 2", file=sys.stderr)
        return 2
    model = None
    if args.model is not None:
        try:
            if len([int(v) for v in args.model.split(",")]) != 3:
                raise ValueError
        except ValueError:
            print(f"host_drift: --model {args.model!r}: give layers,d_model,seq_len, e.g. 4,128,64", file=sys.stderr)
            return 2
        model = (args.model, args.precision)
    from hetrain.hardware.host import host_facts

    host = host_facts()
    print(f"host: {host.describe()}", flush=True)
    result = {"host": host.to_dict(), "window_s": args.window, "seconds": args.seconds, "workload": describe(model)}
    unit = "matmuls" if model is None else "passes"
    for name, n in (("alone", 1), (f"{args.procs}_at_once", args.procs)):
        print(f"{name}: {n} process(es) of {describe(model)}, {args.seconds:g} s in {args.window:g} s windows ...",
              flush=True)
        s = summary(phase(n, args.seconds, args.window, model))
        result[name] = s
        print(f"  {s['mean_per_s']:.1f} {unit}/s per process; slowest window / fastest "
              f"{s['slowest_over_fastest']:.3f}; a {args.window:g} s probe is off the mean by up to "
              f"{s['probe_error_max']:.1%} (median {s['probe_error_median']:.1%})", flush=True)
    shared = result[f"{args.procs}_at_once"]
    result["contention"] = result["alone"]["mean_per_s"] / shared["mean_per_s"]
    print(f"contention: {args.procs} at once run x{result['contention']:.3f} slower each than one alone")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
