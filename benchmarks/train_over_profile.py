"""Does a training step cost an emulated device the CPU its profile says? The part of a wall-clock
miss that is the emulation's own, apart from the host's drift.

On the wall clock an emulated device's time is its thread's CPU time ÷ its speed
(runtime/devices/emulation.Throttle), and the planner costs that CPU from the profiler's passes:
flat out, one after another, at each size (runtime/measure/profiler.py). Training runs the same
forward and backward differently: after each forward the throttle sleeps (1/speed − 1) of the
micro-batch's CPU, then the backward runs (through DDP, under hetrain's hooks). Whatever makes that
pass cost more CPU than a flat-out one (a core that idled in the sleep, DDP's hooks, memory the
step frees and faults in again) slows the emulated device beyond its plan, one way, every step.

A profile measured minutes before the run cannot tell this apart from the host's drift (a pass
here moves 10-40% within seconds: host_drift.py). So this benchmark measures it inside the run:
a data-parallel job on an emulated cluster, and after every second step each rank times, on a
copy of its model, 3 passes of its micro-batch flat out (as the profiler does), 3 paced by a
fresh throttle of its own device (as training does, the same sleep before the backward) and 3
paced through the job's own DDP-wrapped model (its all-reduce and hooks, gradients dropped). Each
block is compared with the two training steps just before it, whose CPU a sample the device's
hooks counted (forward + backward, sleeps excluded), so every ratio is of figures taken seconds
apart in the same process:

    train/flat   a training step's CPU a sample over the flat-out pass's
    plan/flat    what the plan expects of it: the step's compute with the last micro-batch's
                 pacing and DDP costs, measured by the job's probes before its plan (the profile's
                 paced_cost, the sync probe's ddp_cost: planning/cost.py), over the same without
    train/plan   the first over the second: what the plan still misses
    paced/flat   the paced pass's over the flat-out one's (the part the sleep alone explains)
    ddp/flat     the paced pass through DDP over the flat-out one's (the sleep and DDP together)
    forward      train/flat of the model's own forward alone (module hooks, the same in both)
    rest         the rest (the loss, the backward and its gradient sync) over the flat-out
                 pass's: paced, paced through DDP, and training's

It reports each rank's medians over the blocks, its page faults a step, and which rank sets the
step (the most device time a step). A second table sets the step's wall time (the steps not right
after a block) against the plan's prediction and splits the difference: flat/profile is the
host's speed in the run against the profile the job measured a minute before (a flat-out pass
then and now: the host's drift, which no plan can know), step/pred at run speed is the step
against the prediction with its compute and optimizer scaled by that drift (what the plan's model
misses; its sync and agreement kept as measured), train/plan
the emulation's CPU against the plan's, wall/busy the step beyond the device's busy time (its
CPU and sleeps: what remains is the gradient sync, the agreement, the optimizer) and queued the
part of the step the rank waited, runnable, for a core. `--max-train-over-flat F` exits 1 when that rank's train/flat
exceeds F, `--max-train-over-plan F` when its train/plan does: a fix to the emulation or to
the profiler must bring them down.

    python benchmarks/train_over_profile.py --json out.json [--cluster a100-80g:0.5,rtx3090:0.335]
                                            [--steps 50] [--precision auto] [--max-train-over-plan 1.05]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLUSTER = "a100-80g:0.5,rtx3090:0.335"       # layout_accuracy's pair, dilated 2x (--dilate 2)
WARMUP_STEPS = 2
BLOCK_EVERY = 2                              # a block of passes after every second step
PASSES = 3                                   # passes a block, each kind (the first one dropped)
RATIOS = ("train_over_flat", "paced_over_flat", "ddp_over_flat", "forward_over_flat", "rest_over_flat",
          "paced_rest_over_flat", "ddp_rest_over_flat")        # summarise's medians over the blocks


# -- the worker: one rank of the job ----------------------------------------------------------
def worker(out: str, steps: int, global_batch: int, precision: str) -> None:
    import copy
    import resource

    import torch.distributed as dist

    import hetrain
    from hetrain import Rebalancing, Reporting
    from hetrain.runtime.devices.hooks import runqueue_s
    from hetrain.runtime.measure.pacing import timed_pass
    from layout_accuracy import factory, forward_loss, loss_fn

    ht = hetrain.init(global_batch=global_batch, max_steps=steps, seed=0, precision=precision,
                      rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False))
    model, opt, data = factory()
    model, opt, batches = ht.prepare(model, opt, data, parallel="dp", loss_fn=loss_fn)
    job = ht.job
    mine = ht.plan.devices[job.rank]
    inner = getattr(model, "module", model)
    plain = copy.deepcopy(inner)                                 # the profiler's kind of model: no DDP
    x, y = data[:mine.micro_batch]
    compute = job.precision.compute

    # the model's own forward (no loss), timed by module hooks in training and in the passes alike
    forwards = [0.0]

    def forward_started(module, args):
        forwards.append(-time.thread_time())

    def forward_ended(module, args, output):
        forwards[0] += time.thread_time() + forwards.pop()

    for net in (inner, plain):
        net.register_forward_pre_hook(forward_started)
        net.register_forward_hook(forward_ended)

    def passes(paced: bool, net=plain) -> tuple[float, float]:
        """The median CPU seconds a sample of PASSES passes of `net` (the first dropped), flat out
        or paced, and of their model forwards."""
        throttle = job.emulated.throttle.fresh() if paced else None
        times, model_forwards = [], []
        for _ in range(PASSES + 1):
            forwards[0] = 0.0
            # the profiler's own pass (runtime/measure/pacing.py), flat out or paced
            forward, backward = timed_pass(net, (x, y), lambda m, b: forward_loss(m, *b, compute), throttle,
                                           samples=len(x))
            times.append((forward + backward) / len(x))
            model_forwards.append(forwards[0] / len(x))
        return statistics.median(times[1:]), statistics.median(model_forwards[1:])

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    profile, predicted = job.profiles[job.rank], job.plan.predicted
    record = {"rank": job.rank, "label": job.device_label, "speed": job.emulated.spec.speed,
              "share": mine.share, "micro_batch": mine.micro_batch, "precision": compute,
              **plan_over_flat(profile, mine, predicted.get("ddp_cost", 1.0)),
              "predicted_step_s": predicted.get("step_s"),
              "predicted_cpu_s": predicted.get("compute_s", 0.0) + predicted.get("optimizer_s", 0.0),
              # CPU a sample, as profiled
              "profile_s": profile.micro_seconds(mine.micro_batch) * profile.cpu_share / mine.micro_batch,
              "train_s": [], "train_forward_s": [], "busy_s": [], "wall_s": [], "queued_s": [], "faults": [],
              "blocks": []}
    for step in batches:
        f0, forwards[0] = faults(), 0.0
        w0, q0 = time.perf_counter(), runqueue_s()
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
        record["wall_s"].append(time.perf_counter() - w0)
        record["queued_s"].append(runqueue_s() - q0)
        record["faults"].append(faults() - f0)
        record["train_s"].append(job.hooks.compute_s / mine.share)       # CPU a sample, this step
        record["train_forward_s"].append(forwards[0] / mine.share)       # ... of it the model's forwards
        record["busy_s"].append(job.hooks.busy_s)
        done = len(record["train_s"])
        if done % BLOCK_EVERY == 0 and done < steps:
            # every rank here at once, as after each step (the step's sync just ended)
            timed = {kind: passes(*how) for kind, how in
                     (("flat", (False,)), ("paced", (True,)), ("ddp", (True, model)))}
            record["blocks"].append({"after_step": done, **{k: t for k, (t, _) in timed.items()},
                                     **{f"{k}_forward": f for k, (_, f) in timed.items()}})
    records = [None] * job.world_size
    dist.all_gather_object(records, record)
    if ht.is_main:
        Path(out).write_text(json.dumps({"ranks": records}))
    ht.close()


def plan_over_flat(profile, mine, ddp_cost: float) -> dict:
    """What the plan expects a training step's CPU a sample to be over a flat-out pass's: its
    compute with the last micro-batch's pacing and DDP costs (planning/cost.py) over the same
    without them, and the two measured costs it came from."""
    from hetrain.planning.cost import Assignment

    step = Assignment(profile=profile, share=mine.share, micro_batch=mine.micro_batch)
    planned = step.compute_s(ddp_cost=ddp_cost)
    return {"plan_over_flat": planned / (planned - step.last_micro_extra(ddp_cost)),
            "paced_cost": profile.paced_cost, "ddp_cost": ddp_cost}


# -- the figures (pure) -----------------------------------------------------------------------
def summarise(record: dict, *, warmup: int = WARMUP_STEPS) -> dict:
    """One rank's medians over its blocks: each block against the mean of the two training steps
    just before it (none from the warm-up steps)."""
    train, train_forward = record["train_s"], record.get("train_forward_s")
    ratios: dict[str, list[float]] = {k: [] for k in RATIOS}
    for block in record["blocks"]:
        k = block["after_step"]
        if k - BLOCK_EVERY < warmup or block["flat"] <= 0:
            continue
        before = statistics.mean(train[k - BLOCK_EVERY:k])
        ratios["train_over_flat"].append(before / block["flat"])
        ratios["paced_over_flat"].append(block["paced"] / block["flat"])
        if block.get("ddp"):
            ratios["ddp_over_flat"].append(block["ddp"] / block["flat"])
        if train_forward and block.get("flat_forward"):      # the model's forward, and the rest
            fwd = statistics.mean(train_forward[k - BLOCK_EVERY:k])
            flat_rest = block["flat"] - block["flat_forward"]
            ratios["forward_over_flat"].append(fwd / block["flat_forward"])
            ratios["rest_over_flat"].append((before - fwd) / flat_rest)
            ratios["paced_rest_over_flat"].append((block["paced"] - block["paced_forward"]) / flat_rest)
            ratios["ddp_rest_over_flat"].append((block["ddp"] - block["ddp_forward"]) / flat_rest)
    steady = record["faults"][warmup:] or record["faults"]
    planned = record.get("plan_over_flat")
    row = {"rank": record["rank"], "label": record["label"], "speed": record["speed"],
            "share": record["share"], "micro_batch": record["micro_batch"],
            "plan_over_flat": planned, "paced_cost": record.get("paced_cost"), "ddp_cost": record.get("ddp_cost"),
            "train_over_plan": statistics.median(ratios["train_over_flat"]) / planned
            if planned and ratios["train_over_flat"] else None,
            "blocks": len(ratios["train_over_flat"]),
            "flat_ms_per_sample": 1e3 * statistics.median(b["flat"] for b in record["blocks"]) if record["blocks"] else None,
            "profile_ms_per_sample": 1e3 * record["profile_s"] if record.get("profile_s") else None,
            **{k: statistics.median(v) if v else None for k, v in ratios.items()},
            "faults_per_step": statistics.median(steady) if steady else 0,
            "busy_s": statistics.median(record["busy_s"][warmup:] or record["busy_s"]),
            **_step_wall(record, warmup)}
    flat, profiled = row["flat_ms_per_sample"], row["profile_ms_per_sample"]
    row["flat_over_profile"] = flat / profiled if flat and profiled else None
    step, predicted = row.get("step_wall_ms"), row.get("predicted_step_ms")
    row["step_over_predicted"] = step / predicted if step and predicted else None
    # the prediction at the run's speed: its compute and optimizer (the emulated devices' CPU time
    # and the sleeps made from it) scaled by the host's drift; the sync and agreement as they were
    cpu = 1e3 * record.get("predicted_cpu_s", 0.0)
    at_run = predicted + cpu * (row["flat_over_profile"] - 1) if predicted and row["flat_over_profile"] else None
    row["predicted_at_run_speed_ms"] = at_run
    row["step_over_predicted_at_run_speed"] = step / at_run if step and at_run else None
    return row


def _step_wall(record: dict, warmup: int) -> dict:
    """The step's wall time over the device's busy time (its CPU and sleeps: what the plan
    costs), and the share of the step the thread waited runnable for a core; the steps right
    after a block of passes left out (a peer may still be timing its passes as they start)."""
    wall, busy, queued = record.get("wall_s"), record["busy_s"], record.get("queued_s")
    if not wall:
        return {}
    clean = [k for k in range(warmup, len(wall)) if k % BLOCK_EVERY != 0] or list(range(len(wall)))
    predicted = record.get("predicted_step_s")
    return {"step_wall_ms": 1e3 * statistics.median(wall[k] for k in clean),
            "predicted_step_ms": 1e3 * predicted if predicted else None,
            "wall_over_busy": statistics.median(wall[k] / busy[k] for k in clean if busy[k] > 0),
            "queued_share": statistics.median(queued[k] / wall[k] for k in clean if wall[k] > 0)}


def setting_rank(rows: list[dict]) -> int:
    """The rank with the most device time a step: the one the others wait for."""
    return max(rows, key=lambda r: r["busy_s"])["rank"]


def table(rows: list[dict], setter: int) -> str:
    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    lines = [f"{'rank':<5}{'device':<26}{'speed':>6}{'share':>6}{'flat ms/sample':>16}{'train/flat':>12}"
             f"{'plan/flat':>11}{'train/plan':>12}{'paced/flat':>12}{'ddp/flat':>10}{'forward':>9}{'rest: paced':>12}{'ddp':>7}{'train':>7}"
             f"{'faults/step':>13}{'blocks':>8}"]
    for r in rows:
        lines.append(f"{r['rank']:<5}{r['label'][:25]:<26}{r['speed']:>6.3f}{r['share']:>6}"
                     f"{f(r['flat_ms_per_sample'], '.2f'):>16}{f(r['train_over_flat'], '.3f'):>12}"
                     f"{f(r.get('plan_over_flat'), '.3f'):>11}{f(r.get('train_over_plan'), '.3f'):>12}"
                     f"{f(r['paced_over_flat'], '.3f'):>12}{f(r['ddp_over_flat'], '.3f'):>10}"
                     f"{f(r.get('forward_over_flat'), '.3f'):>9}{f(r.get('paced_rest_over_flat'), '.3f'):>12}"
                     f"{f(r.get('ddp_rest_over_flat'), '.3f'):>7}{f(r.get('rest_over_flat'), '.3f'):>7}"
                     f"{r['faults_per_step']:>13.0f}{r['blocks']:>8}"
                     + ("   <- sets the step" if r["rank"] == setter else ""))
    return "\n".join(lines)


def step_table(rows: list[dict], setter: int) -> str:
    """The step against the plan's prediction, and what explains the difference: the host's speed
    between the profile and the run (flat/profile), the emulation's CPU over the plan's
    (train/plan), the step beyond the device's busy time (wall/busy: sync, agreement, optimizer)."""
    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    lines = [f"{'rank':<5}{'predicted ms':>13}{'step ms':>9}{'step/pred':>11}{'profile ms/sample':>19}"
             f"{'flat/profile':>14}{'step/pred at run speed':>24}{'train/plan':>12}{'wall/busy':>11}{'queued':>8}"]
    for r in rows:
        lines.append(f"{r['rank']:<5}{f(r.get('predicted_step_ms'), '.1f'):>13}{f(r.get('step_wall_ms'), '.1f'):>9}"
                     f"{f(r.get('step_over_predicted'), '.3f'):>11}{f(r.get('profile_ms_per_sample'), '.2f'):>19}"
                     f"{f(r.get('flat_over_profile'), '.3f'):>14}{f(r.get('step_over_predicted_at_run_speed'), '.3f'):>24}"
                     f"{f(r.get('train_over_plan'), '.3f'):>12}{f(r.get('wall_over_busy'), '.3f'):>11}"
                     f"{f(r.get('queued_share'), '.1%'):>8}" + ("   <- sets the step" if r["rank"] == setter else ""))
    return "\n".join(lines)


# -- the driver -------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--cluster", default=CLUSTER, help=f"the emulated cluster (default {CLUSTER})")
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50; at least 8)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--max-train-over-flat", type=float, default=None,
                   help="exit 1 when the rank that sets the step trains above this many times its flat-out CPU")
    p.add_argument("--max-train-over-plan", type=float, default=None,
                   help="exit 1 when the rank that sets the step trains above this many times the CPU its plan expects")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.steps < 8:
        print(f"train_over_profile: --steps {args.steps} leaves too few blocks past the warm-up; "
              "use 8 or more (e.g. --steps 50)", file=sys.stderr)
        return 2
    for flag, limit in (("--max-train-over-flat", args.max_train_over_flat),
                        ("--max-train-over-plan", args.max_train_over_plan)):
        if limit is not None and not limit > 0:
            print(f"train_over_profile: {flag} {limit} is not a ratio; e.g. {flag} 1.05", file=sys.stderr)
            return 2
    sys.path.insert(0, str(REPO / "src"))
    from hetrain.errors import UsageError
    from hetrain.launch import build_launch

    try:
        launch = build_launch(target=str(Path(__file__).resolve()), emulate=args.cluster,
                              target_args=("--worker", args.json + ".raw", str(args.steps), str(args.global_batch),
                                           args.precision))
    except UsageError as e:
        print(f"train_over_profile: {e.what}; {e.fix}", file=sys.stderr)
        return 2
    env = {**os.environ, **launch.env,
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    print(f"training {args.steps} steps of data parallelism on {args.cluster}, timing passes every "
          f"{BLOCK_EVERY} steps ...", flush=True)
    proc = subprocess.run(list(launch.argv), env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(f"train_over_profile: the job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return 1
    raw = json.loads(Path(args.json + ".raw").read_text())
    os.remove(args.json + ".raw")
    rows = [summarise(r) for r in raw["ranks"]]
    setter = setting_rank(rows)
    result = {"cluster": args.cluster, "steps": args.steps, "global_batch": args.global_batch,
              "precision": args.precision, "warmup_steps": WARMUP_STEPS, "rows": rows, "sets_the_step": setter,
              "max_train_over_flat": args.max_train_over_flat, "max_train_over_plan": args.max_train_over_plan,
              "raw": raw["ranks"]}
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(table(rows, setter))
    print(step_table(rows, setter))
    row = next(r for r in rows if r["rank"] == setter)
    failed = 0
    for key, limit, what in (("train_over_flat", args.max_train_over_flat, "its flat-out CPU a sample"),
                             ("train_over_plan", args.max_train_over_plan, "the CPU a sample its plan expects")):
        if limit is not None and row[key] is not None and row[key] > limit:
            print(f"rank {setter} trains at {row[key]:.3f}x {what} (limit {limit:g})")
            failed = 1
    return failed


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
