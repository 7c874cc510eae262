"""How well does the planner predict? Plan, run the emulated cluster for real, compare.

For each emulated cluster the demo GPT trains through `hetrain run` exactly as a user's job would:
every rank profiles its device (cached after a round's first run), the ranks gather the profiles and run
the planner, and the plan's predicted samples/s is compared with the samples/s the run measured
(steady state: the first step is left out). With --ddp the same cluster then runs the plain equal
split (every device the same share and micro-batch) from a plan file, to check the planner's
prediction for plain DDP as well. Rebalancing is off in every run, so each runs the split it is compared with.

What the prediction rests on: each rank's profile (CPU time of forward+backward at 1…64 samples,
or on the controlled clock the device's busy time, fitted a + b·m; the optimizer step), pooled over the ranks (one CPU), divided by each device's
emulated speed; the gradient sync as the job measured it through DDP before training (the tail
of a synced backward after its last bucket is launched) and the step's agreement all-reduce; and
the host's core count; how far the last rank trailed the others in that probe (stragglers).

CPU contention: an emulated device of speed s keeps one core busy a fraction s of its time, so a
1 : 0.67 : 0.5 cluster wants 2.17 cores of a 2-core host. The cost model knows the host's core
count and stretches the host-CPU part of each device's compute until the devices computing at a
time fit in the cores (processor sharing, cost.py); the planner splits by the stretched times.
Other work on the host is not modelled (it comes and goes faster than a plan lives), so the
wall-clock figures are only meaningful on a quiet host: the CPU the rest of the host used during
each run is recorded with it. The CPU seconds of each rank's forward+backward per step, predicted
and measured, check the profile and micro-batch model whatever the load.

Precision: `auto` by default, hetrain's rule: each card's own precision in the plan (bf16 on the
A100 and 3090, fp16 on the T4 and V100), computed in fp32 on a host whose CPU runs that dtype
slowly (most CPUs for fp16; those without avx512_bf16/AMX for bf16 too), so every emulated device
keeps its catalog speed on any host. The host's facts are recorded in the JSON.

The equal-split runs are hetrain running an equal split, so they pay hetrain's agreement
all-reduce; their predicted figure is the planner's plain-DDP step plus that agreement (the plan's
own plain-DDP figure, without it, is kept as ddp_plain_predicted_samples_per_s).

Rounds (--rounds, 1 by default): the clusters run interleaved, round after round, and each round
probes afresh (its own profile cache; the host facts are measured once), because on a virtual host
the CPU's speed moves in phases of seconds (one process training this GPT alone in bf16 on a 2-core
AMD EPYC VM took 115-165 ms a step, phase by phase; benchmarks/host_drift.py measures a host's
drift). A prediction made from one probe carries the phase that probe landed in, and a run of 40
steps the phases it met; the median over rounds of each is compared, and every round's pair is
kept in the JSON (`rounds`). One round is the old behaviour.

Clocks (--clock, `auto,wall` by default: both, interleaved within every round). On the
controlled clock (benchmarks/controlled_clock.py) a micro-batch of m samples lasts (a + m·T)/speed,
T calibrated first (3× the fast device's CPU time a sample) and a = --clock-micro × T (4 by
default). The job is told neither: its profiler times each device through the device's own
throttle and fits a + b·m to that, as on any device (runtime/measure/profiler.py), so the fit, the
split and the micro-batches (the capped T4 must run many small ones, each paying a) are checked
against a steady reference. What the clock does impose is each device's compute: every row
reports that share of the step (`imposed_share`: the busiest rank's compute, sleeps included,
over the measured step) and the error over the rest of the step (`rest_rel_error`: the gradient
sync, the agreement, the optimizer and the loop's own work, which stay on the wall clock). The
wall clock (each device's compute its CPU time ÷ its speed) adds the profile's rate of a drifting
CPU, and the CPU per step predicted against measured; the headline reads it against
host_drift.py's probe of this host, run after the clusters. Targets: 5% clocked, 10% wall on a
quiet host. A row fails (marked, exit 1) on an out-of-memory error the plan did not foresee or a
redone step. One --quick run on a shared 2-core AMD EPYC VM (load average 2.4-2.5, 0.4-0.6 cores
of other work during the runs): clocked 3.7-10.6% off, imposed 85-96%; wall 14.9-22.6%, host
drift up to 33%.

Time: the default (3 clusters, 2 clocks, 1 round of 30 steps, no equal-split runs) takes about
3-4 minutes on 2 cores; --quick (the two pairs, 20 steps) about 1.5; --ddp adds the equal splits.

Known gap (emulation only): the emulator settles a wrong guess of the last backward's length
after the gradient sync, which lengthens the step a little.

    python benchmarks/plan_accuracy.py --json out.json [--quick] [--steps 30] [--rounds 1] [--ddp]
                                       [--clock auto,wall|auto|wall|MS] [--clock-micro 4]
                                       [--max-other-cores 0.2 --retries 5]   # on a shared host

With --layout dp|fsdp|capacity|pp|dp-pp|all, each layout's row of the layout ranking is checked
against a run of that layout instead (benchmarks/layout_accuracy.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from controlled_clock import add_clock_arguments, clock_config, clock_s, describe_clock, resolve_clocks
from hostload import children_cpu_s, dilate, host_busy_s

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = {        # name: emulated cluster spec
    "2dev-1:0.67": "a100-80g:1.0,rtx3090:0.67",
    "2dev-1:0.35-capped": "a100-80g:1.0,t4:0.35@24MiB",
    "3dev-1:0.67:0.5": "a100-80g:1.0,rtx3090:0.67,v100-32g:0.5",
}
TARGET = 0.10           # the wall clock's (on a quiet host)
CLOCKED_TARGET = 0.05   # the controlled clock's
QUICK = {"steps": 20, "rounds": 1, "clusters": ("2dev-1:0.67", "2dev-1:0.35-capped"), "drift_s": 4.0}


def predicted_given_load(profiles_of: dict, run: dict, cores: int) -> float:
    """The cost model's samples/s for what `run` did (its shares and micro-batches, the profiles
    and link its plan was made from), with the CPU that other work used during it as extra load.
    On a shared host this separates the model's error from the host's noise; on a quiet one it is
    the plan's own prediction."""
    from hetrain.planning.collectives import FREE_LINK, Link
    from hetrain.planning.cost import Assignment, step_cost
    from hetrain.planning.profile import DeviceProfile

    profiles = [DeviceProfile.from_dict(p) for p in profiles_of["profiles"]]
    pred = profiles_of["predicted"]
    link = (Link(bandwidth_gbs=pred["link_gbs"], latency_s=pred.get("link_latency_s", 0.0))
            if "link_gbs" in pred else FREE_LINK)
    work = [Assignment(profile=p, share=s, micro_batch=m)
            for p, s, m in zip(profiles, run["shares"], run["micro_batches"])]
    return step_cost(work, global_batch=sum(run["shares"]), grad_bytes=pred["grad_bytes"], link=link,
                     host_cores=cores, host_load=run["other_work_cores"], sync_s=pred.get("sync_s"),
                     agree_s=pred.get("agree_s", 0.0),   # both runs are hetrain's, with its agreement
                     straggle=pred.get("straggle", 0.0), straggle_stretch=pred.get("straggle_stretch", 1.0),
                     contention=pred.get("contention", 1.0), clocked=bool(pred.get("clocked", False)),
                     contention_at=int(pred.get("contention_at", 1)),
                     ddp_cost=pred.get("ddp_cost", 1.0)).samples_per_s


def _env(cache: str) -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HETRAIN_CACHE": cache, "COLUMNS": "160"}


def run_demo(spec: str, args, cache: str, workdir: str, tag: str, plan_path: str | None = None, clock=None) -> dict:
    """`_run_demo`, again while other work on the host used more than --max-other-cores (a shared
    host: the run is repeated, up to --retries times, until it had the host to itself)."""
    for attempt in range(args.retries + 1):
        summary = _run_demo(spec, args, cache, workdir, f"{tag}-a{attempt}", plan_path, clock=clock or args)
        if args.max_other_cores is None or summary["other_work_cores"] <= args.max_other_cores:
            break
        print(f"{tag}: other work used {summary['other_work_cores']:.2f} cores during the run; again",
              file=sys.stderr)
        time.sleep(args.retry_wait)
    summary["attempts"] = attempt + 1
    return summary


def _run_demo(spec: str, args, cache: str, workdir: str, tag: str, plan_path: str | None = None, *, clock) -> dict:
    """One `hetrain run` of the demo job; returns its summary (measured and predicted figures)."""
    sys.path.insert(0, str(REPO / "src"))
    from hetrain.launch import build_launch

    out = os.path.join(workdir, f"{tag}.json")
    launch = build_launch(target="hetrain.demo.train_gpt", module=True, emulate=spec,
                          target_args=("--steps", str(args.steps), "--global-batch", str(args.global_batch),
                                       "--precision", args.precision, "--json", out),
                          # Rebalancing off: the run keeps the split whose prediction it is compared
                          # with (with it on, the equal-split runs drifted to hetrain's own split).
                          config={"rebalancing": {"enabled": False}, **({"plan": plan_path} if plan_path else {}),
                                  "emulation": clock_config(clock)},  # the planner is not told it: it measures
                          run_dir=os.path.join(workdir, tag))
    busy0, ours0, t0 = host_busy_s(), children_cpu_s(), time.perf_counter()
    proc = subprocess.run(list(launch.argv), env={**_env(cache), **launch.env}, capture_output=True, text=True,
                          timeout=900)
    wall = time.perf_counter() - t0
    others = max(0.0, (host_busy_s() - busy0) - (children_cpu_s() - ours0)) / wall
    if proc.returncode != 0:
        raise SystemExit(f"{tag}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(Path(out).read_text())
    summary["other_work_cores"] = others
    return summary


def round_cache(work: str, r: int) -> str:
    """Round r's profile cache: its own, so each round's plans come from probes of that round
    (a drifting host then moves the predictions as much as the runs, and the median over rounds
    averages both); the host facts, measured once per host, are carried over from round 0."""
    cache = os.path.join(work, f"cache-r{r}")
    first = os.path.join(work, "cache-r0", "host")
    if r > 0 and os.path.isdir(first):
        shutil.copytree(first, os.path.join(cache, "host"), dirs_exist_ok=True)
    return cache


def equal_split_plan(planned: dict, workdir: str, tag: str) -> str:
    """A plan file with plain DDP's split: equal shares, the smallest micro-batch cap everywhere."""
    from hetrain.planning.plan import DevicePlan, Plan, split_evenly

    shares = split_evenly(sum(planned["shares"]), len(planned["shares"]))
    micro = min([shares[0]] + [m for m in planned["max_micro_batches"] if m is not None])
    equal = Plan(global_batch=sum(shares), note="plain DDP equal split", devices=tuple(
        DevicePlan(rank=r, device=f"rank {r}", speed=1.0, share=s, micro_batch=min(micro, s))
        for r, s in enumerate(shares)))
    path = os.path.join(workdir, f"{tag}-equal-plan.json")
    Path(path).write_text(equal.to_json())
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--steps", type=int, default=None, help="steps a run (default 30; --quick 20)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=None,
                   help="repeat every cluster, each round from its own probes; the medians are compared "
                        "(default 1)")
    p.add_argument("--quick", action="store_true",
                   help="a short check (under 2 minutes on 2 cores): 1 round of 20 steps, the two pairs, "
                        "no equal-split runs, a shorter drift probe")
    p.add_argument("--ddp", action="store_true", help="also run the plain equal split of every cluster")
    p.add_argument("--no-ddp", action="store_true", help=argparse.SUPPRESS)      # the default now
    p.add_argument("--drift-s", type=float, default=None,
                   help="seconds of host_drift.py's probe read beside the wall-clock error (default 10; 0: none)")
    p.add_argument("--max-other-cores", type=float, default=None,
                   help="on a shared host: repeat a run while other work used more than this many cores")
    p.add_argument("--max-host-move", type=float, default=None,
                   help="with --layout, on the wall clock: repeat a run while the host's own speed (two "
                        "processes timing the model's forward+backward together, benchmarks/host_gauge.py, just "
                        "before and after it) was more than this fraction from its speed at the end of the "
                        "plan's probes (e.g. 0.04)")
    p.add_argument("--max-host-burst", type=float, default=None,
                   help="with --layout, on the wall clock: repeat a run while the host itself was slow during "
                        "more than this share of it (a small forward+backward timed every 0.25 s beside the run, "
                        "a pass 1.25x the run's fastest quarter or slower counting as slow; "
                        "benchmarks/host_gauge.py), e.g. 0.1")
    p.add_argument("--retries", type=int, default=5,
                   help="with --max-other-cores, --max-host-move or --max-host-burst: at most this many repeats")
    p.add_argument("--retry-wait", type=float, default=10.0, help="seconds between repeats")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default): each card's own, computed in fp32 where this CPU runs it slowly")
    p.add_argument("--dilate", type=float, default=1.0,
                   help="run every emulated device D× slower (speeds / D): on a busy shared host the "
                        "devices then mostly sleep, which keeps other work's contention out of the figures "
                        "(and the cluster's own: use 1 on a quiet host to test the contention model)")
    p.add_argument("--layout", choices=["dp", "fsdp", "capacity", "pp", "dp-pp", "tp", "all"],
                   help="instead: check the layout ranking's row for this layout (or all) against a run of it "
                        "(benchmarks/layout_accuracy.py)")
    p.add_argument("--model", default="4,128,64", help="with --layout: the demo GPT's layers,d_model,seq_len")
    add_clock_arguments(p, default="auto,wall", micro=True)
    args = p.parse_args(argv)
    if not args.dilate >= 1:
        raise SystemExit("--dilate must be >= 1")
    if args.max_host_move is not None and not (args.layout and args.max_host_move > 0):
        p.error(f"--max-host-move {args.max_host_move:g}: give a fraction above 0 (e.g. 0.04), with --layout "
                "(the layout runs read the host's speed; the planner's own DP runs do not)")
    if args.max_host_burst is not None and not (args.layout and 0 <= args.max_host_burst < 1):
        p.error(f"--max-host-burst {args.max_host_burst:g}: give a share from 0 up to below 1 (e.g. 0.1), with "
                "--layout (the layout runs watch the host; the planner's own DP runs do not)")
    quick = QUICK if args.quick else {}
    args.steps = args.steps or quick.get("steps", 30)
    args.rounds = args.rounds or quick.get("rounds", 1)
    args.drift_s = quick.get("drift_s", 10.0) if args.drift_s is None else args.drift_s
    sys.path.insert(0, str(REPO / "src"))
    # the model trained (--model with --layout, else the demo's), and its clock, calibrated at the
    # fast device's share of the 1 : 0.67 pair
    args.layers, args.d_model, args.seq_len = (int(v) for v in (args.model if args.layout else "4,128,64").split(","))
    clocks = resolve_clocks(args, p, micro_batch=max(1, round(args.global_batch / 1.67)))
    if args.layout:
        import layout_accuracy

        chosen = list(layout_accuracy.LAYOUTS) if args.layout == "all" else [args.layout]
        if args.quick and args.layout == "all":
            chosen = list(layout_accuracy.QUICK_LAYOUTS)
        return layout_accuracy.main(args, chosen, clocks)

    names = [n for n in CLUSTERS if n in quick.get("clusters", CLUSTERS)]
    clusters = {name: dilate(CLUSTERS[name], args.dilate) for name in names}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    by_clock = {}
    with tempfile.TemporaryDirectory(prefix="hetrain-plan-accuracy-") as work:
        measured = {(c.clock, n): [] for c in clocks for n in names}
        equal = {(c.clock, n): [] for c in clocks for n in names}
        for r in range(args.rounds):                 # interleaved, so drift hits every clock and cluster alike
            cache = round_cache(work, r)      # a clocked profile is cached apart from the wall clock's
            for c in clocks:
                for name, spec in clusters.items():
                    s = run_demo(spec, args, cache, work, f"{c.clock}-{name}-r{r}", clock=c)
                    measured[c.clock, name].append(s)
                    if args.ddp:
                        plan_path = equal_split_plan(s, work, f"{c.clock}-{name}-r{r}")
                        equal[c.clock, name].append(run_demo(spec, args, cache, work, f"{c.clock}-{name}-r{r}-equal",
                                                             plan_path, clock=c))
        for c in clocks:
            rows = [cluster_row(name, spec, measured[c.clock, name], equal[c.clock, name], args, c, cores)
                    for name, spec in clusters.items()]
            by_clock[c.clock] = summarise_clock(rows, c)
    drift = None
    if args.drift_s > 0:
        from host_drift import probe_drift

        drift = probe_drift(seconds=args.drift_s)
    from hetrain.hardware.host import host_facts

    host = host_facts()
    result = {
        "model": f"demo GPT (4 layers, d=128, seq 64, precision {args.precision}), AdamW",
        "host": host.to_dict(), "host_summary": host.describe(), "load_average": os.getloadavg(),
        "global_batch": args.global_batch, "steps": args.steps, "rounds": args.rounds, "dilate": args.dilate,
        "host_cores": cores, "targets": {"clocked": CLOCKED_TARGET, "wall": TARGET},
        "clocks": by_clock, "host_drift": drift,
        "load_note": ("wall-clock figures assume the host runs nothing else; other_work_cores is the CPU "
                      "the rest of the host used during each run (host busy time minus the run's own), "
                      "in cores: near 0 on a quiet host"),
    }
    result["failed_rows"] = [f"{k}: {r['cluster']} ({r['fail']})" for k, v in by_clock.items()
                             for r in v["clusters"] if r["fail"]]
    Path(args.json).write_text(json.dumps(result, indent=2))
    for k, v in by_clock.items():
        print(f"-- clock {v['clock']}")
        for r in v["clusters"]:
            print_row(r)
    print(headline(result))
    if result["failed_rows"]:
        print("FAILED: " + "; ".join(result["failed_rows"]), file=sys.stderr)
        raise SystemExit(1)
    return result


def cluster_row(name: str, spec: str, runs: list[dict], equal: list[dict], args, clock, cores: int) -> dict:
    """One cluster on one clock: the plan's prediction against the runs, the share of the step the
    clock imposed (the slowest rank's compute over the step), and what fails the row."""
    from hetrain.hardware.cluster import parse_cluster

    got = statistics.median(s["samples_per_s"] for s in runs)
    pred = statistics.median(s["predicted"]["samples_per_s"] for s in runs)
    step_s = args.global_batch / got
    timed = max(runs[0]["steps"] - 1, 1)
    imposed = statistics.median(max(r["busy_s"] for r in s["ranks"]) / max(s["steps"] - 1, 1)
                                / (args.global_batch / s["samples_per_s"]) for s in runs)
    row = {"cluster": name, "spec": spec, "devices": len(spec.split(",")),
           "shares": runs[0]["shares"], "micro_batches": runs[0]["micro_batches"],
           "predicted_samples_per_s": pred, "measured_samples_per_s": got,
           "rel_error": abs(pred - got) / got,
           "imposed_share": imposed if clock_s(clock) else None,
           "compute_share": imposed,
           # the error over what the clock does not impose: the rest of the step
           "rest_rel_error": abs(args.global_batch / pred - step_s) / (step_s * max(1e-9, 1 - imposed)),
           "predicted_step_s": statistics.median(s["predicted"]["step_s"] for s in runs),
           "measured_step_s": step_s,
           "profiles": [{"overhead_s": q["overhead_s"], "per_sample_s": q["per_sample_s"], "cpu_share": q["cpu_share"]}
                        for q in runs[0].get("profiles", [])],
           "cpu_stretch": statistics.median(s["predicted"]["cpu_stretch"] for s in runs),
           "other_work_cores": [round(s["other_work_cores"], 2) for s in runs],
           "attempts": [s["attempts"] for s in runs],
           "ooms": [sum(int(r["ooms"]) for r in s["ranks"]) for s in runs + equal],
           "redone_steps": [int(s.get("redone_steps", 0)) for s in runs + equal],
           "rounds": [{"predicted": s["predicted"]["samples_per_s"], "measured": s["samples_per_s"],
                       "rel_error": abs(s["predicted"]["samples_per_s"] - s["samples_per_s"]) / s["samples_per_s"]}
                      for s in runs]}
    row["fail"] = "; ".join(filter(None, [
        f"{sum(row['ooms'])} unplanned OOM(s)" if any(row["ooms"]) else "",
        f"{sum(row['redone_steps'])} redone step(s)" if any(row["redone_steps"]) else ""]))
    given_load = statistics.median(predicted_given_load(s, s, cores) for s in runs)
    row["predicted_given_load_samples_per_s"] = given_load
    row["rel_error_given_load"] = abs(given_load - got) / got
    # Load-independent check of the profile and micro-batch model on the wall clock: each rank's
    # CPU seconds of forward+backward per step, predicted (device time ÷ its emulated slowdown)
    # and measured. On the controlled clock the device time is the clock's, not the CPU's: none.
    row["cpu_rel_error"] = None
    if not clock_s(clock):
        speeds = [d.speed for d in parse_cluster(spec)]
        f = row["cpu_stretch"]
        cpu_pred = [c * sp / (1 + sp * (f - 1)) for c, sp in zip(runs[0]["predicted_compute_s"], speeds)]
        cpu_got = [r["compute_s"] / timed for r in runs[0]["ranks"]]
        row["cpu_per_step_predicted_s"] = cpu_pred
        row["cpu_per_step_measured_s"] = cpu_got
        row["cpu_rel_error"] = max(abs(p - g) / g for p, g in zip(cpu_pred, cpu_got))
    if equal:
        ddp_got = statistics.median(s["samples_per_s"] for s in equal)
        plain = statistics.median(s["predicted"]["ddp_samples_per_s"] for s in runs)
        agree_s = statistics.median(s["predicted"].get("agree_s", 0.0) for s in runs)
        ddp_pred = args.global_batch / (args.global_batch / plain + agree_s)
        row["ddp_plain_predicted_samples_per_s"] = plain
        ddp_given = statistics.median(predicted_given_load(s, e, cores) for s, e in zip(runs, equal))
        row.update({"ddp_predicted_given_load_samples_per_s": ddp_given,
                    "ddp_rel_error_given_load": abs(ddp_given - ddp_got) / ddp_got})
        row.update({"ddp_predicted_samples_per_s": ddp_pred, "ddp_measured_samples_per_s": ddp_got,
                    "ddp_rel_error": abs(ddp_pred - ddp_got) / ddp_got,
                    "measured_speedup_vs_equal": got / ddp_got,
                    "predicted_speedup_vs_equal": pred / ddp_pred})
    return row


def summarise_clock(rows: list[dict], clock) -> dict:
    return {"clock": describe_clock(clock), "clocked": bool(clock_s(clock)), "clusters": rows,
            "target_rel_error": CLOCKED_TARGET if clock_s(clock) else TARGET,
            "max_rel_error": max(r["rel_error"] for r in rows),
            "max_rest_rel_error": max(r["rest_rel_error"] for r in rows),
            "max_ddp_rel_error": max((r["ddp_rel_error"] for r in rows if "ddp_rel_error" in r), default=None),
            "max_cpu_rel_error": max((r["cpu_rel_error"] for r in rows if r["cpu_rel_error"] is not None), default=None),
            "max_rel_error_given_load": max(r["rel_error_given_load"] for r in rows)}


def print_row(r: dict) -> None:
    extra = (f"; equal split predicted {r['ddp_predicted_samples_per_s']:.1f}, measured "
             f"{r['ddp_measured_samples_per_s']:.1f}" if "ddp_rel_error" in r else "")
    share = r["imposed_share"]
    print(f"{r['cluster']:>20}: shares {r['shares']} micro {r['micro_batches']}, predicted "
          f"{r['predicted_samples_per_s']:.1f} samples/s, measured {r['measured_samples_per_s']:.1f} "
          f"({r['rel_error']:.1%} off"
          + (f"; the clock imposed {share:.0%} of the step, the rest {r['rest_rel_error']:.1%} off" if share is not None
             else f"; compute {r['compute_share']:.0%} of the step") + f"){extra}"
          + (f"; CPU/step within {r['cpu_rel_error']:.1%}" if r["cpu_rel_error"] is not None else "")
          + f"; other work {r['other_work_cores']} cores" + (f"  FAIL: {r['fail']}" if r["fail"] else ""))


def headline(result: dict) -> str:
    """The clocked error beside the wall clock's, and the host's drift the latter reads against."""
    parts = []
    for v in result["clocks"].values():
        kind = "clocked" if v["clocked"] else "wall"
        verdict = "within" if v["max_rel_error"] <= v["target_rel_error"] else "OVER"
        parts.append(f"{kind} max error {v['max_rel_error']:.1%} ({verdict} its {v['target_rel_error']:.0%} target"
                     + (f"; of the part the clock does not impose: {v['max_rest_rel_error']:.1%}" if v["clocked"] else "")
                     + ")")
    drift = result.get("host_drift")
    if drift:
        parts.append(f"host drift: a {drift['window_s']:g}-s probe of {drift['procs']} processes off its phase's "
                     f"mean by up to {drift['probe_error_max']:.1%} (median {drift['probe_error_median']:.1%})")
    load = result.get("load_average")
    if load:
        parts.append(f"load average {load[0]:.2f}")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
