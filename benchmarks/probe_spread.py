"""How far `hetrain plan`'s prediction of each layout moves when its probes run again.

A prediction rests on seconds of probes (the profiler, the pipeline, FSDP2 and TP probes:
runtime/measure/). On a shared host every probe samples the host's noise, so the same cluster
planned twice gives two figures; how far they lie apart bounds how well any single prediction can
match a run, whatever the model. This runs `hetrain plan --model-factory` K times on one emulated
cluster, each time from an empty cache (so every probe runs again), and prints each layout row's
predictions and their spread, (largest − least) / median. The layouts and the model are those of
layout_accuracy.py, on the wall clock.

    python benchmarks/probe_spread.py --cluster 4dev --plans 4 --json out.json
    python benchmarks/probe_spread.py --cluster 2dev --plans 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layout_accuracy as la          # noqa: E402  (benchmarks/ is not a package)
from hostload import dilate           # noqa: E402

ROWS = {"2dev": ("dp", "fsdp", "capacity", "pp", "tp"), "4dev": ("dp", "dp-pp")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--cluster", choices=sorted(ROWS), default="4dev",
                   help=f"the emulated cluster: {la.CLUSTERS}")
    p.add_argument("--plans", type=int, default=4, help="how many times to plan it, each from fresh probes")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--dilate", type=float, default=2.0, help="every emulated device D× slower (as layout_accuracy)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--model", default="4,128,64", help="the demo GPT's layers,d_model,seq_len")
    args = p.parse_args(argv)
    if args.plans < 2:
        p.error("--plans: at least 2 (a spread needs two figures)")
    args.clock_ms = args.clock_micro_ms = None          # the wall clock
    spec = dilate(la.CLUSTERS[args.cluster], args.dilate)
    got: dict[str, list[float]] = {n: [] for n in ROWS[args.cluster]}
    details: dict[str, list[str]] = {n: [] for n in got}
    pipelines = []
    started = time.perf_counter()
    for k in range(args.plans):
        with tempfile.TemporaryDirectory(prefix="hetrain-probe-spread-") as work:
            t0 = time.perf_counter()
            found = la.ranking_for(spec, args, os.path.join(work, "cache"), work, args.model)
        pipelines.append(found["pipeline"])
        for name in got:
            row = la.row_of(name, found["ranking"], 2 if la.LAYOUTS[name][1] != "dp" else None)
            got[name].append(row["samples_per_s"])
            details[name].append(row["detail"])
        print(f"plan {k + 1}/{args.plans} ({time.perf_counter() - t0:.0f} s): "
              + ", ".join(f"{n} {v[-1]:.1f}" for n, v in got.items()), file=sys.stderr, flush=True)
    rows = [{"layout": n, "predicted_samples_per_s": v, "median": statistics.median(v), "spread": la.spread(v),
             "details": details[n]} for n, v in got.items()]
    result = {"cluster": spec, "plans": args.plans, "global_batch": args.global_batch, "rows": rows,
              "pipelines": pipelines,        # what each plan's pipeline probe measured
              "seconds": time.perf_counter() - started, "load_average": os.getloadavg()}
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"{'layout':<10}{'median/s':>10}{'spread':>8}  predictions")
    for r in rows:
        print(f"{r['layout']:<10}{r['median']:>10.1f}{r['spread']:>8.1%}  "
              + ", ".join(f"{x:.1f}" for x in r["predicted_samples_per_s"]))
    return result


if __name__ == "__main__":
    main()
