"""Chaos: N random faults (kills, out-of-memory errors, hangs) thrown at one emulated training run,
in every layout.

For each layout, runs the same job twice through `hetrain run --max-restarts`: once clean, once
with a seeded random schedule of faults (runtime/devices/faults.py), and reports how many faults
were injected and survived, how many restarts they caused, the wall time lost, whether the final
parameters equal the clean run's, and whether every sample was used exactly once per epoch.

    python benchmarks/chaos.py --layout all --json chaos.json [--faults 20] [--steps 30] [--seed 0]

Layouts (--layout, one or several, or `all`):
    dp        parallel='dp', sharding='none' (DDP)            on a100-80g,rtx3090
    zero1     parallel='dp', sharding='zero1'                 on a100-80g,rtx3090
    fsdp      parallel='dp', sharding='fsdp' (FSDP2)          on a100-80g,rtx3090
    capacity  parallel='dp', sharding='capacity'              on a100-80g,rtx3090
    pp        parallel='pp', one pipeline of 2 stages         on a100-80g,rtx3090
    dp-pp     parallel='dp-pp', 2 replicas x 2 stages         on a100-80g,rtx3090,a100-80g,rtx3090

The job is a small residual-block model in float64, trained with SGD (momentum) through the one
loop of every layout (`ht.backward(ht.loss(mb))`, loss_fn= in prepare). Its final parameters are
gathered by whole-model name (under a pipeline each rank holds its stage's) and compared with the
clean run's: equal within 1e-6 relative, not bitwise, because an OOM halves a micro-batch (and a
restart may re-plan the shares), so a gradient is summed in another order; float64 keeps that
rounding near 1e-15, far below the tolerance, while a lost or doubled sample or step moves the
parameters by orders of magnitude more. `exact` in the JSON says whether they were bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

PAIR = "a100-80g,rtx3090"
QUAD = "a100-80g,rtx3090,a100-80g,rtx3090"
# layout -> (parallel=, sharding=, emulated cluster, ranks per replica)
LAYOUTS = {
    "dp": ("dp", "none", PAIR, 1),
    "zero1": ("dp", "zero1", PAIR, 1),
    "fsdp": ("dp", "fsdp", PAIR, 1),
    "capacity": ("dp", "capacity", PAIR, 1),
    "pp": ("pp", "none", PAIR, 2),
    "dp-pp": ("dp-pp", "none", QUAD, 2),
}
GLOBAL_BATCH = 128
DATASET = 320
MICRO = 32            # data parallel: at most 32 samples a micro-batch (5 halvings to 1)
PIPE_MICRO_BATCHES = 2   # a pipeline: 2 micro-batches per step (pp: 64 samples each, dp-pp: ~32)
REL_TOL = 1e-6
SHUTDOWN_S = 2


# -- the job (run by each worker) -----------------------------------------------------------------
def make_model():
    import torch
    from torch import nn

    from hetrain.parallel import PipelineParts

    class Residual(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.fc = nn.Linear(h, h)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class ChaosNet(nn.Module):
        """Residual blocks in a ModuleList: FSDP2's units and a pipeline's cut points."""

        def __init__(self, d: int = 16, h: int = 32, n_blocks: int = 4):
            super().__init__()
            self.inp = nn.Linear(d, h)
            self.blocks = nn.ModuleList(Residual(h) for _ in range(n_blocks))
            self.out = nn.Linear(h, 1)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

        def pipeline_parts(self):
            return PipelineParts(first=self.inp, blocks=tuple(self.blocks), last=self.out)

    torch.manual_seed(0)
    return ChaosNet().double()


def whole_parameters(model) -> dict:
    """{whole-model name: tensor} over all ranks (a collective): each rank gives the parameters it
    holds (`model.parameters()`; under a pipeline its stage's), named by identity in the user's
    model; FSDP2's shards are gathered whole."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    held = {id(p) for p in model.parameters()}
    mine = {}
    for name, p in model.module.named_parameters():
        if id(p) in held:
            t = p.detach()
            mine[name] = (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {}
    for part in everyone:
        for name, t in part.items():
            merged.setdefault(name, t)
    return merged


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Checkpoints, Emulation, Memory, Rebalancing, Reporting

    parallel, sharding, _, _ = LAYOUTS[args.layout]
    ht = hetrain.init(global_batch=GLOBAL_BATCH, max_steps=args.steps,
                      checkpoints=Checkpoints(dir=args.ckpt, every=args.every),
                      reporting=Reporting(sample_log=f"{args.ckpt}/samples", verbose=True),
                      rebalancing=Rebalancing(enabled=False), memory=Memory(max_micro_batch=MICRO),
                      emulation=Emulation(sample_s=0.002), timeout_s=args.timeout, precision="fp32",
                      sharding=sharding)   # the controlled clock: splits by speed
    g = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET, 16, generator=g, dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, torch.sin(x[:, :4]).sum(1, keepdim=True))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    extra = {"micro_batches": PIPE_MICRO_BATCHES} if parallel in ("pp", "dp-pp") else {}
    model, opt, batches = ht.prepare(model, opt, data, parallel=parallel, loss_fn=F.mse_loss, **extra)
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
    params = whole_parameters(model)                                  # (collective)
    if ht.is_main:
        # torchrun's restart count of the attempt that finished: every restart the faults caused
        torch.save({"params": params, "restarts": ht.ctx.restart}, args.out)
    ht.close()


# -- the schedule -------------------------------------------------------------------------------
def die_phases(layout: str) -> list[str]:
    """Where a kill can strike. Under a pipeline ht.backward() only records; the schedule's
    backward runs in no hook a `die:phase=backward` fault strikes from, so kills there come at a
    step's start or while a checkpoint is written."""
    parallel = LAYOUTS[layout][0]
    return ["start", "checkpoint"] if parallel in ("pp", "dp-pp") else ["start", "backward", "checkpoint"]


def oom_budget(layout: str) -> tuple[list[list[int]], int]:
    """The groups of ranks that share one micro-batch size (a pipeline replica's stages shrink
    together), and how many halvings each can take before a micro-batch of 1 (then an OOM is fatal)."""
    parallel, _, cluster, group = LAYOUTS[layout]
    world = len(cluster.split(","))
    groups = [list(range(r, r + group)) for r in range(0, world, group)]
    if parallel == "dp":
        micro = MICRO
    else:
        micro = GLOBAL_BATCH // len(groups) // PIPE_MICRO_BATCHES
    # the slower device of a pair gets the smaller share: leave it one halving to spare
    return groups, max(1, int(math.log2(micro)) - 1)


def schedule(n: int, steps: int, every: int, seed: int, layout: str = "dp") -> list[str]:
    """n faults: about half OOMs (recovered inside the step), the rest kills and hangs (restarts).

    Restart-causing fault i fires in restart attempt i. A kill while a checkpoint is written can
    only strike at a checkpoint step (a multiple of `every`). An OOM at step s fires in the attempt
    that first runs s: the number of restart faults at earlier steps."""
    rng = random.Random(seed)
    groups, budget = oom_budget(layout)
    world = sum(len(g) for g in groups)
    n_oom = min(n // 2, budget * len(groups))
    n_stall = max(1, n // 7) if n - n_oom > 0 else 0
    n_die = n - n_oom - n_stall
    kinds = ["stall"] * n_stall + ["die"] * n_die
    rng.shuffle(kinds)
    used: set[int] = set()
    planned = []
    for kind in kinds:
        phase = rng.choice(die_phases(layout)) if kind == "die" else "start"
        choices = [s for s in range(2, steps - 1) if s not in used and (phase != "checkpoint" or s % every == 0)]
        step = rng.choice(choices)
        used.add(step)
        planned.append((step, kind, phase))
    faults = []
    for attempt, (step, kind, phase) in enumerate(sorted(planned)):
        rank = rng.randrange(world)
        faults.append(f"die:rank={rank},step={step},phase={phase},attempt={attempt}" if kind == "die"
                      else f"stall:rank={rank},step={step},attempt={attempt}")
    free = [s for s in range(1, steps) if s not in used]
    per_group = Counter()
    for step in sorted(rng.sample(free, n_oom)):
        g = min(range(len(groups)), key=lambda i: (per_group[i], rng.random()))   # spread over the groups
        per_group[g] += 1
        rank = rng.choice(groups[g])
        attempt = sum(1 for s in used if s < step)
        micro, phase = rng.choice([(0, "forward"), (-1, "forward"), (0, "backward"), (-1, "backward")])
        faults.append(f"oom:rank={rank},step={step},micro={micro},phase={phase},attempt={attempt}")
    return faults


# -- the driver ---------------------------------------------------------------------------------
def launch(tmp: Path, name: str, args, layout: str, faults: list[str] | None) -> tuple[float, Path, Path, str, str]:
    ckpt, out, log = tmp / f"{name}-ckpt", tmp / f"{name}.pt", tmp / f"{name}-faults.jsonl"
    # A hung (SIGSTOPped) worker ignores torchrun's SIGTERM: SIGKILL it after 2 s, not the default
    # grace (which is for preemption checkpoints; this job has none to write).
    env = {**os.environ, "HETRAIN_FAULT_LOG": str(log), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_S)}
    env.pop("HETRAIN_FAULTS", None)
    if faults:
        env["HETRAIN_FAULTS"] = ";".join(faults)
    cmd = [sys.executable, "-m", "hetrain", "run", "--emulate", LAYOUTS[layout][2],
           "--max-restarts", str(len(faults or ()) + 2), __file__, "--worker", "--layout", layout,
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


def compare(chaos_out: Path, clean_out: Path) -> tuple[bool, bool, float]:
    """(within REL_TOL, bitwise, largest relative difference) of two runs' parameters, by name."""
    import torch

    a, b = torch.load(chaos_out)["params"], torch.load(clean_out)["params"]
    if sorted(a) != sorted(b):
        return False, False, math.inf
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)).item() for k in b)
    return worst <= REL_TOL, all(torch.equal(a[k], b[k]) for k in b), worst


def samples_once(ckpt: Path, steps: int) -> bool:
    from hetrain.runtime.resilience.resume import read_sample_log

    log = read_sample_log(str(ckpt / "samples"))
    pairs = [pair for s in sorted(log) for pair in log[s]]
    per_epoch = Counter(e for e, _ in pairs)
    return (sorted(log) == list(range(steps)) and len(pairs) == len(set(pairs)) == steps * GLOBAL_BATCH
            and all(per_epoch[e] == DATASET for e in per_epoch if e < max(per_epoch)))


def run_layout(layout: str, args, tmp: Path) -> dict:
    """The clean run and the chaos run of one layout, and their figures."""
    faults = schedule(args.faults, args.steps, args.every, args.seed, layout)
    clean_s, clean_out, _, _, clean_error = launch(tmp, f"{layout}-clean", args, layout, None)
    if clean_error:
        raise SystemExit(f"{layout}: the clean run failed: {clean_error}")
    chaos_s, chaos_out, ckpt, stdout, error = launch(tmp, f"{layout}-chaos", args, layout, faults)
    log = tmp / f"{layout}-chaos-faults.jsonl"
    fired = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finished = not error and chaos_out.exists()
    equal, exact, worst = compare(chaos_out, clean_out) if finished else (False, False, math.inf)
    parallel, sharding, cluster, _ = LAYOUTS[layout]
    import torch

    return {
        "layout": layout, "parallel": parallel, "sharding": sharding, "cluster": cluster,
        "planned": len(faults),
        "injected": len(fired),
        "survived": len(fired) if finished else 0,
        "restarts": torch.load(chaos_out)["restarts"] if finished else None,
        "resumes_from_checkpoint": stdout.count("resumed from step-"),
        "seconds_lost": round(chaos_s - clean_s, 1),
        "params_equal": bool(equal), "exact": bool(exact),
        "max_rel_diff": worst if math.isfinite(worst) else None,
        "samples_once": bool(finished and samples_once(ckpt, args.steps)),
        "by_kind": dict(Counter(f["kind"] for f in fired)),
        "clean_seconds": round(clean_s, 1), "chaos_seconds": round(chaos_s, 1),
        "error": error or None,
        "not_injectable": [] if parallel == "dp" else ["die in backward (a pipeline's backward runs in the schedule)"],
        "schedule": faults,
    }


COLUMNS = ("layout", "injected", "survived", "restarts", "seconds_lost", "params_equal", "samples_once")


def table(rows: list[dict]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(COLUMNS, widths)) for r in rows]
    return "\n".join(lines)


def parse_layouts(text: str) -> list[str]:
    names = list(LAYOUTS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        raise SystemExit(f"--layout {text!r}: use `all` or some of {', '.join(LAYOUTS)}")
    return names


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="all", help=f"all, or comma-separated: {', '.join(LAYOUTS)}")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--faults", type=int, default=20, help="faults per layout")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--timeout", type=float, default=8, help="collective timeout: a hang becomes an error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    layouts = parse_layouts(args.layout)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            print(f"{layout}: clean run, then {args.faults} faults ...", flush=True)
            row = run_layout(layout, args, Path(tmp))
            rows.append(row)
            print(f"{layout}: {row['injected']}/{row['planned']} injected {row['by_kind']}, "
                  f"{row['survived']} survived, {row['restarts']} restarts, {row['seconds_lost']} s lost, "
                  f"params equal {row['params_equal']} (max rel diff {row['max_rel_diff']}), "
                  f"samples once {row['samples_once']}" + (f"; FAILED: {row['error']}" if row["error"] else ""),
                  flush=True)
    print(table(rows))
    if args.json:
        from hetrain.hardware.host import host_facts

        setup = {"steps": args.steps, "global_batch": GLOBAL_BATCH, "dataset": DATASET, "checkpoint_every": args.every,
                 "collective_timeout_s": args.timeout,
                 "torchrun_shutdown_timeout_s": SHUTDOWN_S, "seed": args.seed, "faults_per_layout": args.faults,
                 "model": "4 residual blocks, width 32, float64, SGD momentum 0.9", "precision": "fp32 (float64 model)",
                 "params_equal_means": f"every parameter within {REL_TOL:g} relative (exact: bitwise)"}
        Path(args.json).write_text(json.dumps({"rows": rows, "setup": setup, "wall_seconds": round(time.perf_counter() - t0, 1),
                                               "host": host_facts().to_dict()}, indent=2))


if __name__ == "__main__":
    main()
