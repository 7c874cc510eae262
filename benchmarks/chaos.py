"""Chaos: N random faults (kills, out-of-memory errors, hangs) thrown at one emulated training run.

Runs the same job twice through `hetrain run --max-restarts`: once clean, once with a seeded
random schedule of faults (runtime/devices/faults.py), and reports how many faults were injected and
survived, how many restarts they caused, the wall time lost, whether the final parameters equal
the clean run's, and whether every sample was used exactly once per epoch.

    python benchmarks/chaos.py --json chaos.json [--faults 20] [--steps 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

PAIR = "a100-80g,rtx3090"
GLOBAL_BATCH = 64
DATASET = 160
MICRO = 32


# -- the job (run by each worker) -----------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import hetrain

    ht = hetrain.init(global_batch=GLOBAL_BATCH, max_steps=args.steps, checkpoint_dir=args.ckpt,
                      checkpoint_every=args.every, sample_log=f"{args.ckpt}/samples", rebalance=False,
                      micro_batch=MICRO, timeout_s=args.timeout, verbose=True, precision=args.precision)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(x[:, :4]).sum(1, keepdim=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, batches = ht.prepare(model, opt, data)
    for step in batches:
        for mb in step:
            with mb:
                xb, yb = mb.batch
                ht.backward(F.mse_loss(model(xb), yb))
        ht.step()
    if ht.is_main:
        torch.save([p.detach() for p in model.parameters()], args.out)
    ht.close()


# -- the schedule -------------------------------------------------------------------------------
def schedule(n: int, steps: int, every: int, seed: int) -> list[str]:
    """n faults: about half OOMs (recovered inside the step), the rest kills and hangs (restarts).

    Restart-causing fault i fires in restart attempt i. A kill while a checkpoint is written can
    only strike at a checkpoint step (a multiple of `every`). An OOM at step s fires in the attempt
    that first runs s: the number of restart faults at earlier steps."""
    rng = random.Random(seed)
    n_oom = n // 2
    n_stall = max(1, n // 7)
    n_die = n - n_oom - n_stall
    kinds = ["stall"] * n_stall + ["die"] * n_die
    rng.shuffle(kinds)
    used: set[int] = set()
    planned = []
    for kind in kinds:
        phase = rng.choice(["start", "backward", "checkpoint"]) if kind == "die" else "start"
        choices = [s for s in range(2, steps - 1) if s not in used and (phase != "checkpoint" or s % every == 0)]
        step = rng.choice(choices)
        used.add(step)
        planned.append((step, kind, phase))
    faults = []
    for attempt, (step, kind, phase) in enumerate(sorted(planned)):
        rank = rng.randrange(2)
        faults.append(f"die:rank={rank},step={step},phase={phase},attempt={attempt}" if kind == "die"
                      else f"stall:rank={rank},step={step},attempt={attempt}")
    free = [s for s in range(1, steps) if s not in used]
    per_rank = Counter()
    for step in sorted(rng.sample(free, n_oom)):
        rank = min((0, 1), key=lambda r: (per_rank[r], rng.random()))   # at most ~n/4 each: a
        per_rank[rank] += 1                                            # micro-batch of 32 halves 5x
        attempt = sum(1 for s in used if s < step)
        micro, phase = rng.choice([(0, "forward"), (-1, "forward"), (0, "backward"), (-1, "backward")])
        faults.append(f"oom:rank={rank},step={step},micro={micro},phase={phase},attempt={attempt}")
    return faults


# -- the driver ---------------------------------------------------------------------------------
def launch(tmp: Path, name: str, args, faults: list[str] | None) -> tuple[float, Path, Path, str]:
    ckpt, out, log = tmp / f"{name}-ckpt", tmp / f"{name}.pt", tmp / f"{name}-faults.jsonl"
    env = {**os.environ, "HETRAIN_FAULT_LOG": str(log)}
    if faults:
        env["HETRAIN_FAULTS"] = ";".join(faults)
    cmd = [sys.executable, "-m", "hetrain", "run", "--emulate", PAIR, "--max-restarts", str(args.faults + 2),
           __file__, "--worker", "--steps", str(args.steps), "--every", str(args.every),
           "--timeout", str(args.timeout), "--ckpt", str(ckpt), "--out", str(out), "--precision", args.precision]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], file=sys.stderr)
    return seconds, out, ckpt, result.stdout if result.returncode == 0 else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--timeout", type=float, default=10, help="collective timeout: a hang becomes an error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: each card's own, computed in fp32 where this CPU runs it slowly")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import torch

    from hetrain.runtime.resilience.resume import read_sample_log

    faults = schedule(args.faults, args.steps, args.every, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        clean_s, clean_out, _, _ = launch(tmp, "clean", args, None)
        print(f"clean run: {clean_s:.1f} s", flush=True)
        chaos_s, chaos_out, ckpt, stdout = launch(tmp, "chaos", args, faults)
        fired = [json.loads(line) for line in (tmp / "chaos-faults.jsonl").read_text().splitlines()]
        finished = chaos_out.exists()
        final_equal = finished and max(
            (a - b).abs().max().item() for a, b in zip(torch.load(chaos_out), torch.load(clean_out))) <= 1e-5
        log = read_sample_log(str(ckpt / "samples")) if finished else {}
        pairs = [pair for s in sorted(log) for pair in log[s]]
        per_epoch = Counter(e for e, _ in pairs)
        exactly_once = (finished and sorted(log) == list(range(args.steps)) and len(pairs) == len(set(pairs))
                        and all(per_epoch[e] == DATASET for e in per_epoch if e < max(per_epoch)))
        figures = {
            "injected": len(fired),
            "survived": len(fired) if finished else 0,
            "restarts": stdout.count("resumed from step-"),
            "seconds_lost": round(chaos_s - clean_s, 1),
            "final_equal": bool(final_equal),
            "samples_exactly_once": bool(exactly_once),
            "by_kind": dict(Counter(f["kind"] for f in fired)),
            "clean_seconds": round(clean_s, 1), "chaos_seconds": round(chaos_s, 1),
            "schedule": faults,
            "setup": {"steps": args.steps, "global_batch": GLOBAL_BATCH, "checkpoint_every": args.every,
                      "collective_timeout_s": args.timeout, "cluster": PAIR, "seed": args.seed},
        }
    for key in ("injected", "survived", "restarts", "seconds_lost", "final_equal", "samples_exactly_once", "by_kind"):
        print(f"{key:<22} {figures[key]}")
    if args.json:
        from hetrain.hardware.host import host_facts

        Path(args.json).write_text(json.dumps({**figures, "precision": args.precision,
                                               "host": host_facts().to_dict()}, indent=2))


if __name__ == "__main__":
    main()
