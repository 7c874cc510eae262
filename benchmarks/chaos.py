"""Chaos: N random faults (kills, out-of-memory errors, hangs) thrown at one emulated training run,
in every layout.

Each layout's job (benchmarks/_chaos_job.py: float64, SGD with momentum) runs twice through
`hetrain run --max-restarts`, clean and under a seeded schedule of faults (runtime/devices/faults.py);
reported: faults injected and survived, restarts, wall time lost, whether the final parameters
(gathered whole by the model's names) equal the clean run's, every sample used once per epoch.

    python benchmarks/chaos.py --layout all --json chaos.json [--faults 20] [--steps 30] [--seed 0]
    python benchmarks/chaos.py --smoke      (seconds: dp, 2 faults, 6 steps; the same code path)

Layouts: LAYOUTS below (--layout one, several or all). Parameters equal: within 1e-6 relative, not
bitwise (a halved micro-batch sums a gradient in another order), each tensor against its largest
magnitude floored at 1e-12 of the model's largest: docs/resilience.md says why. `exact`: bitwise
equal; `worst_param`: the tensor furthest apart. Exit 0 when every layout survived every fault
with the clean run's parameters and every sample once, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PAIR = "a100-80g,rtx3090"
QUAD = "a100-80g,rtx3090,a100-80g,rtx3090"
JOB = Path(__file__).with_name("_chaos_job.py")   # what each worker runs


@dataclass(frozen=True)
class Case:
    parallel: str                 # dp | pp | dp-pp | tp: which layout object chaos_job.py passes
    sharding: str = "none"        # DataParallel(sharding=...)
    cluster: str = PAIR
    group: int = 1                # ranks that share one micro-batch size (a pipeline replica, a TP group)
    model: str = "residual"       # residual (float64 stack) | gpt2 (Hugging Face, from a config)
    oom_restarts: bool = False    # in-loop OOM recovery is off: an OOM ends the attempt, resumed smaller
    resplit: bool = False         # stage 1 slowed 3x from step 1, rebalancing on: its blocks move online
    blocks: int = 4


LAYOUTS = {
    "dp": Case("dp"),
    "zero1": Case("dp", "zero1"),
    "fsdp": Case("dp", "fsdp"),
    "capacity": Case("dp", "capacity"),
    "capacity-full": Case("dp", "capacity-full", oom_restarts=True),
    "pp": Case("pp", group=2),
    "dp-pp": Case("dp-pp", cluster=QUAD, group=2),
    "tp": Case("tp", group=2, model="gpt2", oom_restarts=True),
    "pp-resplit": Case("pp", cluster="a100-80g,a100-80g", group=2, resplit=True, blocks=6),
}
GLOBAL_BATCH = 128
DATASET = 320
MICRO = 32            # data and tensor parallel: at most 32 samples a micro-batch (5 halvings to 1)
PIPE_MICRO_BATCHES = 2   # a pipeline: 2 micro-batches per step (pp: 64 samples each, dp-pp: ~32)
REL_TOL = 1e-6
FLOOR = 1e-12         # of the model's largest parameter: below it a tensor holds float64 rounding alone
SHUTDOWN_S = 2
SLOWDOWN = "slow:rank=1,step=1,factor=3"   # pp-resplit, in the clean run and the chaos run alike
RESPLIT_FROM = 8      # pp-resplit: no restart before this step, so the first attempt moves its blocks
RESPLIT = "pipeline re-split at step"     # what the job's log says at each re-split


# -- the schedule -------------------------------------------------------------------------------
def oom_budget(layout: str) -> tuple[list[list[int]], int]:
    """The groups of ranks that share one micro-batch size (a pipeline replica, a TP group), and
    the halvings each can take before a micro-batch of 1 (then an OOM is fatal)."""
    case = LAYOUTS[layout]
    world = len(case.cluster.split(","))
    groups = [list(range(r, r + case.group)) for r in range(0, world, case.group)]
    micro = MICRO if case.parallel in ("dp", "tp") else GLOBAL_BATCH // len(groups) // PIPE_MICRO_BATCHES
    # the slower device of a pair gets the smaller share: leave it one halving to spare
    return groups, max(1, int(math.log2(micro)) - 1)


def schedule(n: int, steps: int, every: int, seed: int, layout: str = "dp") -> list[str]:
    """n faults: about half OOMs, the rest kills and hangs. Restart-causing fault i fires in
    attempt i, each at its own step (a kill in a checkpoint at a multiple of `every`); an in-loop
    OOM at step s in the attempt that first runs s. A pipeline's backward runs in the schedule, in
    no hook a kill strikes from. pp-resplit: no restart before RESPLIT_FROM, so the first attempt
    re-splits."""
    rng = random.Random(seed)
    case = LAYOUTS[layout]
    phases = ["start", "checkpoint"] if case.parallel in ("pp", "dp-pp") else ["start", "backward", "checkpoint"]
    groups, budget = oom_budget(layout)
    world = sum(len(g) for g in groups)
    n_oom = min(n // 2, budget * len(groups))
    n_stall = n // 7      # a hang costs the collective timeout: a few of them (none in a smoke)
    n_die = n - n_oom - n_stall
    oom_groups = []
    per_group = Counter()
    for _ in range(n_oom):
        g = min(range(len(groups)), key=lambda i: (per_group[i], rng.random()))   # spread over the groups
        per_group[g] += 1
        oom_groups.append(g)
    kinds = ["stall"] * n_stall + ["die"] * n_die + (["oom"] * n_oom if case.oom_restarts else [])
    rng.shuffle(kinds)
    first = RESPLIT_FROM if case.resplit else 2
    used: set[int] = set()
    planned = []
    for kind in kinds:
        phase = rng.choice(phases) if kind == "die" else "start"
        free = [s for s in range(first, steps - 1) if s not in used]
        at_checkpoint = [s for s in free if s % every == 0]
        if phase == "checkpoint" and not at_checkpoint:
            phase = "start"
        if not free:
            raise SystemExit(f"{layout}: {len(kinds)} restart faults do not fit {steps} steps; give more --steps")
        step = rng.choice(at_checkpoint if phase == "checkpoint" else free)
        used.add(step)
        planned.append((step, kind, phase))
    oom_ranks = iter(rng.choice(groups[g]) for g in oom_groups)
    oom_where = [(0, "forward"), (-1, "forward"), (0, "backward"), (-1, "backward")]
    faults = []
    for attempt, (step, kind, phase) in enumerate(sorted(planned)):
        if kind == "oom":
            micro, where = rng.choice(oom_where)
            faults.append(f"oom:rank={next(oom_ranks)},step={step},micro={micro},phase={where},attempt={attempt}")
            continue
        rank = rng.randrange(world)
        faults.append(f"die:rank={rank},step={step},phase={phase},attempt={attempt}" if kind == "die"
                      else f"stall:rank={rank},step={step},attempt={attempt}")
    if case.oom_restarts:
        return faults
    free = [s for s in range(1, steps) if s not in used]
    for step in sorted(rng.sample(free, n_oom)):
        rank = next(oom_ranks)
        attempt = sum(1 for s in used if s < step)
        micro, phase = rng.choice(oom_where)
        faults.append(f"oom:rank={rank},step={step},micro={micro},phase={phase},attempt={attempt}")
    return faults


# -- the driver ---------------------------------------------------------------------------------
def launch(tmp: Path, name: str, args, layout: str, faults: list[str] | None) -> tuple[float, Path, Path, str, str]:
    ckpt, out, log = tmp / f"{name}-ckpt", tmp / f"{name}.pt", tmp / f"{name}-faults.jsonl"
    case = LAYOUTS[layout]
    # A hung (SIGSTOPped) worker ignores torchrun's SIGTERM: SIGKILL it after 2 s, not the default
    # grace (which is for preemption checkpoints; this job has none to write).
    env = {**os.environ, "HETRAIN_FAULT_LOG": str(log), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_S)}
    env.pop("HETRAIN_FAULTS", None)
    spec = ([SLOWDOWN] if case.resplit else []) + list(faults or ())
    if spec:
        env["HETRAIN_FAULTS"] = ";".join(spec)
    cmd = [sys.executable, "-m", "hetrain", "run", "--emulate", case.cluster,
           "--max-restarts", str(len(faults or ()) + 2), str(JOB), "--layout", layout, "--blocks", str(case.blocks),
           "--steps", str(args.steps), "--every", str(args.every), "--timeout", str(args.timeout),
           "--ckpt", str(ckpt), "--out", str(out)]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    error = ""
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        error = lines[-1] if lines else f"exit {result.returncode}"
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
    return seconds, out, ckpt, result.stdout, error


def compare(a: dict, b: dict) -> tuple[bool, bool, float, str | None]:
    """(within REL_TOL, bitwise, largest relative difference, its name) of two runs' parameters
    {name: tensor}; each tensor's difference over its largest magnitude, floored at FLOOR of the
    model's largest (docs/resilience.md says why)."""
    import torch

    if sorted(a) != sorted(b):
        return False, False, math.inf, None
    floor = FLOOR * max(t.abs().max().item() for t in b.values())
    rel = {k: ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(max(floor, 1e-300))).item() for k in b}
    name = max(rel, key=rel.get)
    return rel[name] <= REL_TOL, all(torch.equal(a[k], b[k]) for k in b), rel[name], name


def samples_once(ckpt: Path, steps: int) -> bool:
    from hetrain.runtime.resilience.resume import read_sample_log

    log = read_sample_log(str(ckpt / "samples"))
    pairs = [pair for s in sorted(log) for pair in log[s]]
    per_epoch = Counter(e for e, _ in pairs)
    return (sorted(log) == list(range(steps)) and len(pairs) == len(set(pairs)) == steps * GLOBAL_BATCH
            and all(per_epoch[e] == DATASET for e in per_epoch if e < max(per_epoch)))


def run_layout(layout: str, args, tmp: Path) -> dict:
    """The clean run, then the chaos run of one layout, and their figures. Under --smoke the two
    run at once (seconds, not a figure of time lost)."""
    import torch

    faults = schedule(args.faults, args.steps, args.every, args.seed, layout)
    with ThreadPoolExecutor(2 if args.smoke else 1) as pool:
        clean = pool.submit(launch, tmp, f"{layout}-clean", args, layout, None)
        chaos = pool.submit(lambda: None if not args.smoke and clean.result()[4] else    # no chaos after a failed clean
                            launch(tmp, f"{layout}-chaos", args, layout, faults))
        (clean_s, clean_out, _, clean_stdout, clean_error), chaos = clean.result(), chaos.result()
    if clean_error:
        raise SystemExit(f"{layout}: the clean run failed: {clean_error}")
    chaos_s, chaos_out, ckpt, stdout, error = chaos
    log = tmp / f"{layout}-chaos-faults.jsonl"
    fired = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    fired = [f for f in fired if f["kind"] != "slow"]     # pp-resplit's slowdown: the layout's, not a fault
    finished = not error and chaos_out.exists()
    equal, exact, worst, worst_param = (compare(torch.load(chaos_out)["params"], torch.load(clean_out)["params"])
                                        if finished else (False, False, math.inf, None))
    case = LAYOUTS[layout]
    return {
        "layout": layout, "parallel": case.parallel, "sharding": case.sharding, "cluster": case.cluster,
        "model": case.model, "planned": len(faults), "injected": len(fired), "survived": len(fired) if finished else 0,
        "restarts": torch.load(chaos_out)["restarts"] if finished else None,
        "resumes_from_checkpoint": stdout.count("resumed from step-"), "resplits": stdout.count(RESPLIT),
        "clean_resplits": clean_stdout.count(RESPLIT), "seconds_lost": round(chaos_s - clean_s, 1),
        "params_equal": bool(equal), "exact": bool(exact),
        "max_rel_diff": worst if math.isfinite(worst) else None, "worst_param": worst_param,
        "samples_once": bool(finished and samples_once(ckpt, args.steps)),
        "by_kind": dict(Counter(f["kind"] for f in fired)),
        "clean_seconds": round(clean_s, 1), "chaos_seconds": round(chaos_s, 1), "error": error or None,
        "not_injectable": (["die in backward (a pipeline's backward runs in the schedule)"]
                           if case.parallel in ("pp", "dp-pp") else []),
        "ooms_restart": case.oom_restarts, "schedule": faults}


COLUMNS = ("layout", "injected", "survived", "restarts", "resplits", "seconds_lost", "params_equal", "samples_once")


def table(rows: list[dict]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(COLUMNS, widths)) for r in rows]
    return "\n".join(lines)


def parse_layouts(p, text: str) -> list[str]:
    names = list(LAYOUTS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        p.error(f"--layout {text}: unknown layout {', '.join(unknown) or '(none given)'}; "
                f"use all or some of {', '.join(LAYOUTS)}")
    return names


def main(argv=None) -> int:
    from _common import Parser, add_smoke, apply_smoke    # (here: tests load this file for its schedule alone)

    p = Parser(prog="chaos.py", description=__doc__.splitlines()[0])
    p.add_argument("--layout", default=None, help=f"all (the default), or comma-separated: {', '.join(LAYOUTS)}")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--faults", type=int, default=20, help="faults per layout")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--timeout", type=float, default=8, help="collective timeout: a hang becomes an error")
    p.add_argument("--seed", type=int, default=0)
    add_smoke(p)
    args = p.parse_args(argv)
    # smoke: one layout, a kill (a restart from a checkpoint) and an in-loop OOM, 6 steps
    apply_smoke(p, args, faults=2, steps=6, every=2)
    layouts = parse_layouts(p, args.layout or ("dp" if args.smoke else "all"))
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            print(f"{layout}: clean run, then {args.faults} faults ...", flush=True)
            row = run_layout(layout, args, Path(tmp))
            rows.append(row)
            print(f"{layout}: {row['injected']}/{row['planned']} injected {row['by_kind']}, "
                  f"{row['survived']} survived, {row['restarts']} restarts, {row['resplits']} re-splits, "
                  f"{row['seconds_lost']} s lost, params equal {row['params_equal']} (max rel diff "
                  f"{row['max_rel_diff']} in {row['worst_param']}), samples once {row['samples_once']}"
                  + (f"; FAILED: {row['error']}" if row["error"] else ""), flush=True)
    print(table(rows))
    if args.json:
        from hetrain.hardware.host import host_facts

        setup = {"steps": args.steps, "global_batch": GLOBAL_BATCH, "dataset": DATASET, "checkpoint_every": args.every,
                 "collective_timeout_s": args.timeout, "smoke": args.smoke,
                 "torchrun_shutdown_timeout_s": SHUTDOWN_S, "seed": args.seed, "faults_per_layout": args.faults,
                 "models": {"residual": "4 residual blocks (pp-resplit: 6), width 32, float64, SGD momentum 0.9",
                            "gpt2": "Hugging Face GPT-2 from a config: 2 layers, 8 heads, width 32, float64, SGD "
                                    "momentum 0.9"},
                 "precision": "fp32 (float64 model)", "pp_resplit_slowdown": SLOWDOWN,
                 "params_equal_means": f"every parameter within {REL_TOL:g} relative to its largest magnitude, "
                                       f"floored at {FLOOR:g} of the model's largest (exact: bitwise)"}
        Path(args.json).write_text(json.dumps({"rows": rows, "setup": setup, "wall_seconds": round(time.perf_counter() - t0, 1),
                                               "host": host_facts().to_dict()}, indent=2))
    bad = [r["layout"] for r in rows if not (r["params_equal"] and r["samples_once"] and r["survived"] == r["planned"])]
    if bad:
        print(f"chaos.py: not survived with the clean run's parameters and every sample once: {', '.join(bad)}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
