"""How steady is this host? The floor under every wall-clock prediction made here.

A plan's prediction comes from a few seconds of probes at the start of a job (runtime/measure/);
a run lasts a minute or more. On a shared or virtual host the CPU's own speed drifts between the
two: a neighbour's load, frequency changes, the hypervisor. No prediction from a short probe can be
closer to the run's average than the host's own drift, so this benchmark measures that drift with
a workload that does not change: one thread's fp32 matmuls, counted in windows of --window
seconds, first in one process, then in --procs processes at once (as emulated devices run).

It reports, for each phase, each window's rate, the spread (slowest window / fastest) and how far
a probe as long as one window would be from the whole phase's mean (the largest and the typical
|window / mean - 1|); and the slowdown of running --procs at once (the contention the cost model
measures at a job's start).

    python benchmarks/host_drift.py --json host_drift.json [--seconds 40 --window 2 --procs 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch


def rates(seconds: float, window: float, start_at: float, out) -> None:
    """Matmuls per second in each `window` of `seconds`, from the shared start time on."""
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b                                   # warm-up: allocation, first-touch
    while time.time() < start_at:
        time.sleep(0.001)
    found, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < window:
            a @ b
            n += 1
        found.append(n / (time.perf_counter() - t0))
    out.put(found)


def phase(procs: int, seconds: float, window: float) -> list[list[float]]:
    """Each process's window rates, all processes started together."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 3.0                # time for the spawned interpreters to import torch
    ps = [ctx.Process(target=rates, args=(seconds, window, start_at, q)) for _ in range(procs)]
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


def probe_drift(*, seconds: float = 10.0, window: float = 2.0, procs: int = 2) -> dict:
    """The drift the accuracy benchmarks read their wall-clock errors against: `procs` processes
    at once (as emulated devices run) for `seconds`, how far one `window` (a probe's length) is
    from the whole phase's mean (summary()'s figures, and the settings)."""
    return {**summary(phase(procs, seconds, window)), "seconds": seconds, "window_s": window, "procs": procs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    p.add_argument("--window", type=float, default=2.0, help="seconds per window (a probe's length)")
    p.add_argument("--procs", type=int, default=2, help="processes at once in the second phase")
    args = p.parse_args(argv)
    if args.seconds < 2 * args.window or args.window <= 0 or args.procs < 1:
        print("host_drift: --seconds must hold at least two --window(s), and --procs must be >= 1; "
              "e.g. --seconds 40 --window 2 --procs 2", file=sys.stderr)
        return 2
    from hetrain.hardware.host import host_facts

    host = host_facts()
    print(f"host: {host.describe()}", flush=True)
    result = {"host": host.to_dict(), "window_s": args.window, "seconds": args.seconds}
    for name, n in (("alone", 1), (f"{args.procs}_at_once", args.procs)):
        print(f"{name}: {n} process(es), {args.seconds:g} s in {args.window:g} s windows ...", flush=True)
        s = summary(phase(n, args.seconds, args.window))
        result[name] = s
        print(f"  {s['mean_per_s']:.0f} matmuls/s per process; slowest window / fastest "
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
