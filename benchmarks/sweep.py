"""A sweep over an emulated A100 + RTX 3090 against the same trials one after another on the A100.

Both sides are `hetrain sweep` runs of the trials this file defines (space/memory/train below:
a fixed MLP and a fixed number of steps, so every trial is the same work whatever Optuna
suggests; no pruning, so no side stops trials early), each on a fresh study:

    pair       --emulate a100-80g,rtx3090   two trials at a time, the 3090 at 0.67 the A100's speed
    alone      --emulate a100-80g           one trial at a time on the fastest device

The figure is the wall time of the whole command (worker start-up included, as a user waits for
it), measured for both in one run, in interleaved rounds (pair, alone, alone, pair, ...), medians
reported. Ideal: alone = N·t, pair ≈ N·t/(1 + 0.67), a ratio near 0.6 plus start-up. Nothing is
predicted: a ratio at or above 1 fails.

    python benchmarks/sweep.py [--trials 8] [--rounds 2] [--json out.json] [--clock wall|MS]

--clock MS puts the emulated devices on the controlled clock (a step of 32 samples lasts
32·MS/speed): steady on a drifting host, at the price of imposing each device's compute time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BATCH, STEPS, WIDTH = 32, 1500, 256


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True)}


def memory(params):
    return {"params": 9 * WIDTH + WIDTH * WIDTH, "batch": BATCH, "activation_bytes_per_sample": 16 * WIDTH}


def train(params, ctx):
    torch.manual_seed(ctx.number)
    x = torch.randn(BATCH, 8)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
    for step in range(STEPS):
        with ctx.compute(samples=BATCH):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return loss.item()


def run(emulate: str, trials: int, tmp: str, tag: str, clock: str) -> dict:
    storage, out = os.path.join(tmp, f"{tag}.db"), os.path.join(tmp, f"{tag}.json")
    cmd = [sys.executable, "-m", "hetrain", "sweep", os.path.abspath(__file__), "--emulate", emulate,
           "--trials", str(trials), "--storage", storage, "--pruner", "none", "--json", out]
    if clock != "wall":
        cmd += ["--emulate-sample-s", str(float(clock) / 1000)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{r.stderr[-3000:]}")
    data = json.loads(open(out).read())
    return {"wall_s": wall, "devices": data["devices"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clock", default="wall", help="wall, or the controlled clock's ms per sample")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    walls: dict[str, list[float]] = {"pair": [], "alone": []}
    per_device: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            order = ("pair", "alone") if k % 2 == 0 else ("alone", "pair")
            for side in order:
                emulate = "a100-80g,rtx3090" if side == "pair" else "a100-80g"
                got = run(emulate, args.trials, tmp, f"{side}{k}", args.clock)
                walls[side].append(got["wall_s"])
                per_device[f"{side}{k}"] = got["devices"]
                print(f"round {k + 1}: {side:5s} {got['wall_s']:.1f} s  " + ", ".join(
                    f"{d['device']}: {d['complete']} trials, {d['utilisation']:.0%} busy" for d in got["devices"]))
    pair, alone = statistics.median(walls["pair"]), statistics.median(walls["alone"])
    ratio = pair / alone
    print(f"{args.trials} trials: A100 + 3090 {pair:.1f} s, A100 alone one after another {alone:.1f} s: "
          f"ratio {ratio:.3f} (ideal with start-up left out: 1/1.67 = 0.599); {'PASS' if ratio < 1 else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trials": args.trials, "rounds": args.rounds, "clock": args.clock, "walls": walls,
                       "pair_s": pair, "alone_s": alone, "ratio": ratio, "devices": per_device,
                       "cores": os.cpu_count()}, f, indent=1)
    sys.exit(0 if ratio < 1 else 1)


if __name__ == "__main__":
    main()
