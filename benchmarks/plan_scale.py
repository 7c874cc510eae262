"""How long planning takes on a large mixed cluster: 64 devices (8 nodes × 8) and 1,024 (128 × 8).

    python benchmarks/plan_scale.py [--json out.json] [--repeats 5] [--model gpt2-350m] [--no-cli] [--smoke]

The cluster is written in the node grammar, as a user would (so parsing and the hierarchical
all-reduce over the nodes are timed too): nodes of A100-80G (NVLink), RTX 3090 (PCIe 4), V100-32G
(NVLink) and T4 (PCIe 3), and nodes with two kinds inside, over 25GbE — heterogeneous across the
job and within some nodes. Global batch 8 per device. The phases (PHASES) are the functions
`hetrain simulate` and `hetrain plan` call, in process, each timed on its own (plan_once): parse,
topology, profiles, make_plan, compare (compare_parallelism over equal blocks of the preset: DP vs
one pipeline vs every DP×PP layout) and rank (rank_layouts: every layout ranked).

Each size runs --repeats times (median; the total counts compare twice, inside rank too: an upper
bound), then `hetrain simulate` and `hetrain plan --model` end to end in a fresh interpreter.
Targets (2 cores): the plan < 1 s at 64 devices, < 10 s at 1,024, compare_parallelism <= 2 s at
1,024; PASS or MISS is reported, never failed on.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

NODE_KINDS = ("8xa100-80g/nvlink", "8xrtx3090/pcie4", "8xv100-32g/nvlink", "8xt4/pcie3",
              "4xa100-80g,4xrtx3090/pcie4", "4xv100-32g,4xt4/pcie3")
from _common import Parser, add_smoke, apply_smoke  # noqa: E402

SIZES = (8, 128)                      # nodes of 8 devices
TARGETS = {64: 1.0, 1024: 10.0}       # seconds, the whole plan in process
LAYOUTS_TARGET_1024 = 2.0
PHASES = ("parse", "topology", "profiles", "make_plan", "compare", "rank")


def cluster_spec(nodes: int) -> str:
    return "; ".join(f"node{i}={NODE_KINDS[i % len(NODE_KINDS)]}" for i in range(nodes)) + "; net=25GbE"


def plan_once(spec: str, model: str) -> tuple[dict[str, float], str]:
    """One plan of the spec, each phase timed; returns the times and the layout chosen."""
    from hetrain.hardware.cluster import parse_cluster_spec
    from hetrain.planning.cost import GRAD_ELEMENT_BYTES
    from hetrain.planning.ranking import ModelState, rank_layouts
    from hetrain.planning.options import PlanOptions
    from hetrain.planning.parallelism import compare_parallelism
    from hetrain.runtime.layouts.pipeline.split import PipelineProfile, StageDevice
    from hetrain.planning.planner import make_plan
    from hetrain.planning.presets import fine_tuned
    from hetrain.planning.simulate import cluster_profiles
    from hetrain.planning.topology import topology_sync

    t: dict[str, float] = {}
    clock = time.perf_counter
    start = clock()
    parsed = parse_cluster_spec(spec)
    t["parse"] = clock() - start
    m = fine_tuned(model)
    grad_bytes = m.trainable * GRAD_ELEMENT_BYTES
    batch = 8 * len(parsed.devices)

    start = clock()
    topology = topology_sync(parsed, grad_bytes)
    t["topology"] = clock() - start

    start = clock()
    profiles = cluster_profiles(parsed.devices, m)
    t["profiles"] = clock() - start

    start = clock()
    make_plan(profiles, PlanOptions(global_batch=batch, grad_bytes=grad_bytes, link=topology.link))
    t["make_plan"] = clock() - start

    # Equal blocks from the fastest device's profile, one search at 8 micro-batches: the search
    # alone (the ranking's own calls, with its model state and boundary bytes, are timed in rank).
    start = clock()
    fastest = min(profiles, key=lambda p: p.per_sample_s)
    layer = PipelineProfile.uniform(n_blocks=m.blocks, seconds_per_sample=fastest.per_sample_s,
                                    activation_bytes_per_sample=fastest.activation_bytes_per_sample,
                                    param_bytes=grad_bytes, source="benchmark")
    devices = [StageDevice(name=p.device, speed=fastest.per_sample_s / p.per_sample_s, memory_bytes=p.memory_bytes)
               for p in profiles]
    choice = compare_parallelism(layer, devices, global_batch=batch, memory_margin=0.10, link=topology.link)
    t["compare"] = clock() - start

    start = clock()     # as cli/simulate.py _rank
    state = ModelState.from_spec(m, precision="bf16", optimizer="adamw")
    ranking = rank_layouts(profiles, state=state, options=PlanOptions(global_batch=batch, grad_bytes=grad_bytes,
                                                                       link=topology.link, memory_margin=0.10))
    t["rank"] = clock() - start
    return t, f"{choice.choice.name}; ranked best: {ranking.best.name if ranking.best else 'none fits'}"


def cli_once(command: str, spec: str, model: str, devices: int) -> float:
    flag = "--cluster" if command == "simulate" else "--emulate"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "200"}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "hetrain", command, flag, spec, "--model", model,
                        "--global-batch", str(8 * devices)], capture_output=True, text=True, env=env, timeout=600)
    took = time.perf_counter() - start
    if r.returncode:
        raise SystemExit(f"hetrain {command} failed ({r.returncode}): {r.stderr[-2000:]}")
    return took


def verdict(seconds: float, target: float) -> str:
    return "PASS" if seconds < target else "MISS"


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="gpt2-350m", help="a preset whose blocks are known (default: %(default)s)")
    ap.add_argument("--no-cli", action="store_true", help="skip the end-to-end command runs")
    add_smoke(ap)
    args = ap.parse_args()
    apply_smoke(ap, args, repeats=1, no_cli=True)     # the 1,024 devices' plan once, in process

    from hetrain.planning.presets import fine_tuned

    if not fine_tuned(args.model).blocks:
        raise SystemExit(f"--model {args.model}: its block count is unknown, so no DP×PP layout is searched")
    out = {"model": args.model, "repeats": args.repeats, "smoke": args.smoke, "cpus": os.cpu_count(), "python": platform.python_version(),
           "node_kinds": list(NODE_KINDS), "sizes": {}}
    for nodes in SIZES:
        spec, n = cluster_spec(nodes), nodes * 8
        runs, chosen = map(list, zip(*(plan_once(spec, args.model) for _ in range(args.repeats))))
        median = {ph: statistics.median(r[ph] for r in runs) for ph in PHASES}
        total = statistics.median(sum(r.values()) for r in runs)
        row = {"devices": n, "nodes": nodes, "global_batch": 8 * n, "layout": chosen[-1],
               "phases_s": median, "total_s": total, "target_s": TARGETS[n],
               "verdict": verdict(total, TARGETS[n]), "runs": runs}
        if n == 1024:
            row["compare_target_s"] = LAYOUTS_TARGET_1024
            row["compare_verdict"] = verdict(median["compare"], LAYOUTS_TARGET_1024)
        if not args.no_cli:
            row["cli_s"] = {c: statistics.median(cli_once(c, spec, args.model, n) for _ in range(max(1, args.repeats // 2)))
                            for c in ("simulate", "plan")}
        out["sizes"][str(n)] = row

    print(f"planning time, {args.model}, median of {args.repeats} ({os.cpu_count()} CPUs), seconds")
    print(f"{'devices':>8} " + " ".join(f"{ph:>10}" for ph in PHASES) + f" {'total':>8}  target  "
          + ("" if args.no_cli else f"{'simulate':>9} {'plan':>6}  ") + "layout")
    for row in out["sizes"].values():
        cli = "" if args.no_cli else f"{row['cli_s']['simulate']:>9.2f} {row['cli_s']['plan']:>6.2f}  "
        print(f"{row['devices']:>8} " + " ".join(f"{row['phases_s'][ph]:>10.3f}" for ph in PHASES)
              + f" {row['total_s']:>8.3f}  <{row['target_s']:<4g} {row['verdict']}  {cli}{row['layout']}")
    big = out["sizes"]["1024"]
    print(f"compare_parallelism at 1024 devices: {big['phases_s']['compare']:.3f} s (target <= "
          f"{LAYOUTS_TARGET_1024:g} s) {big['compare_verdict']}")
    if not args.no_cli:
        print("simulate / plan: the command end to end in a fresh interpreter (imports included, "
              "every layout ranked)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
