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

    python benchmarks/sweep.py [--trials 8] [--rounds 2] [--json out.json] [--clock wall|MS] [--mix] [--smoke]

--mix: two trials in three declared large (30 GiB: the A100 holds one, two 3090s sharded do) on
a100-80g,rtx3090,rtx3090 (docs/integrations.md). --smoke: 2 trials of a few steps, one round.
--clock MS: the controlled clock (a step of 32 samples lasts 32·MS/speed), steady on a drifting host.
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

BATCH, WIDTH = 32, 256
STEPS = int(os.environ.get("HETRAIN_SWEEP_BENCH_STEPS", "1500"))      # the workers import this file too
MIX = os.environ.get("HETRAIN_SWEEP_BENCH_MIX") == "1"
LARGE_PARAMS = 1_800_000_000      # AdamW: 26.8 GiB of state, + 32 x 100 MiB of activations


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True), "large": MIX and trial.number % 3 != 2}


def memory(params):
    if params["large"]:
        return {"params": LARGE_PARAMS, "batch": BATCH, "activation_bytes_per_sample": 100 * 2**20}
    return {"params": 9 * WIDTH + WIDTH * WIDTH, "batch": BATCH, "activation_bytes_per_sample": 16 * WIDTH}


def model_and_data(ctx):
    torch.manual_seed(ctx.number)
    x = torch.randn(BATCH, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    return model, x, x.sum(dim=1, keepdim=True)


def train(params, ctx):
    model, x, y = model_and_data(ctx)
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
    if ctx.group:                 # a large trial over several devices: one hetrain data-parallel job
        return train_group(model, opt, x, y, ctx)
    for step in range(STEPS):
        with ctx.compute(samples=BATCH):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return loss.item()


def train_group(model, opt, x, y, ctx):
    import hetrain

    # the same steps of the same batch, the batch split between the members by speed
    data = torch.utils.data.TensorDataset(x.repeat(STEPS, 1), y.repeat(STEPS, 1))
    ht = hetrain.init(global_batch=BATCH, max_steps=STEPS, shuffle=False)
    model, opt, batches = ht.prepare(model, opt, data, parallel=hetrain.DataParallel(sharding=ctx.sharding))
    for step in batches:
        for mb in step:
            with mb:
                xb, yb = mb.batch
                ht.backward(torch.nn.functional.mse_loss(model(xb), yb))
        ht.step()
        last = step.loss
    ht.close()
    return last


def run(emulate: str, trials: int, tmp: str, tag: str, clock: str) -> dict:
    storage, out = os.path.join(tmp, f"{tag}.db"), os.path.join(tmp, f"{tag}.json")
    cmd = [sys.executable, "-m", "hetrain", "sweep", os.path.abspath(__file__), "--emulate", emulate,
           "--trials", str(trials), "--storage", storage, "--pruner", "none", "--json", out]
    if clock != "wall":
        cmd += ["--emulate-sample-s", str(float(clock) / 1000)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{r.stderr[-3000:]}")
    data = json.loads(open(out).read())
    return {"wall_s": wall, "devices": data["devices"], "groups": data.get("groups", []),
            "placed": [t["device"] for t in data["trials_run"]]}


ENV = dict(os.environ)


def main() -> None:
    from _common import launched      # here: the workers load this file as the objective, without _common
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clock", default="wall", help="wall, or the controlled clock's ms per sample")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mix", action="store_true", help="small and large trials on a100-80g,rtx3090,rtx3090")
    ap.add_argument("--steps", type=int, default=None, help="steps per trial (default 1500, --smoke 20)")
    ap.add_argument("--smoke", action="store_true", help="2 trials of 20 steps, one round: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.rounds, args.steps = 2, 1, args.steps or 20
    ENV["HETRAIN_SWEEP_BENCH_STEPS"] = str(args.steps or STEPS)
    ENV["HETRAIN_SWEEP_BENCH_MIX"] = "1" if args.mix else "0"
    many = "a100-80g,rtx3090,rtx3090" if args.mix else "a100-80g,rtx3090"
    walls: dict[str, list[float]] = {"pair": [], "alone": []}
    per_device: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, side, got in launched(("pair", "alone"), args.rounds, lambda k, side: run(
                many if side == "pair" else "a100-80g", args.trials, tmp, f"{side}{k}", args.clock), smoke=args.smoke):
            walls[side].append(got["wall_s"])
            per_device[f"{side}{k}"] = got["devices"]
            print(f"round {k + 1}: {side:5s} {got['wall_s']:.1f} s  " + ", ".join(
                f"{d['device']}: {d['complete']} trials, {d['utilisation']:.0%} busy" for d in got["devices"])
                + "".join(f", group {g['group']}: {g['complete']} trials" for g in got["groups"]))
    pair, alone = statistics.median(walls["pair"]), statistics.median(walls["alone"])
    ratio = pair / alone
    ideal = "1/2.34 = 0.427 before start-up and the group's sync" if args.mix else "1/1.67 = 0.599 before start-up"
    print(f"{args.trials} trials{' (mixed: 2 in 3 large)' if args.mix else ''}: {many} {pair:.1f} s, A100 alone "
          f"one after another {alone:.1f} s: ratio {ratio:.3f} (ideal {ideal}); "
          + ("smoke: start-up only, not judged" if args.smoke else "PASS" if ratio < 1 else "FAIL"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trials": args.trials, "rounds": args.rounds, "clock": args.clock, "mix": args.mix,
                       "cluster": many, "steps": int(ENV["HETRAIN_SWEEP_BENCH_STEPS"]), "walls": walls,
                       "pair_s": pair, "alone_s": alone, "ratio": ratio, "devices": per_device,
                       "cores": os.cpu_count()}, f, indent=1)
    # --smoke checks that the commands run: trials of a few steps are start-up, so its ratio is not judged
    sys.exit(0 if ratio < 1 or args.smoke else 1)


if __name__ == "__main__":
    main()
