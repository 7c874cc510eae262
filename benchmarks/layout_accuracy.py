"""How well does the layout ranking predict each layout? Rank, run each layout for real, compare.

`hetrain plan --model-factory` ranks every layout (planning/layouts.rank_layouts); this checks
each row that runs on emulation here against a real run of that layout on the same emulated
cluster: DP (sharding 'none'), FSDP2 (sharding='fsdp'), DP + capacity (sharding='capacity') and
a 2-stage pipeline (parallel='pp') and tensor parallelism split by speed
(parallel=TensorParallel(split='speed')) on a mixed pair, DP×PP 2×2 (parallel='dp-pp') on four devices.

Predicted: for each cluster `hetrain plan --model-factory THIS_FILE:factory --measurements M.json`
runs first (the job's own processes measure the model; profiles are cached in HETRAIN_CACHE), and
the ranking is computed from M.json exactly as cli/planning.py computes the one it prints
(planning_profiles, options_from_measurements, ModelState from plan_worker's model facts). The
training runs that follow read the same cached profiles, and the same cached pipeline measurement
(the blocks and how much longer a stage runs them, runtime/measure/block_cache.py), so a
pipeline's run has the split the ranking costed. Pipelines also record the runtime's own
prediction (the pipeline plan it makes from that measurement).

Measured: rank 0 times every step; the first two steps (warm-up, first allocations, FSDP2's
lazy init) are left out. Peak memory per rank is the emulated meter's (parameters, gradients,
optimizer state and saved activations, as counted in runtime/devices/emulation.py).

Targets: samples/s within 5% on the controlled clock and 10% on the wall clock (a quiet host),
peak memory (the largest device's) within 15%. Memory, emulated, is a check of the model of what
is held (the state, the micro-batches in flight), not of the count: the profile's activation bytes
and the run's peak come from the same saved-tensor meter. A row fails (marked, exit 1) on an
out-of-memory error the plan did not foresee or a redone step.

Clocks (plan_accuracy.py's --clock, `auto,wall` by default, interleaved within each round;
benchmarks/controlled_clock.py says why): on the controlled clock a data-parallel micro-batch of m
samples lasts (a + m·T)/speed and `hetrain plan` is told neither: its ranks profile their devices
through their own throttles (runtime/measure/profiler.py) and its FSDP2 probe times both steps on
the clock, so the DP, FSDP2 and capacity rows are predictions. So are the pipelines' rows: a
stage's piece lasts (a + µ·T)·share/speed, `share` its blocks' measured part of the model's time
(runtime/parallel/pipeline.py), and the ranking costs the stages from the blocks' shares and
what the profiler measured on the clock (the fastest device's seconds a sample, and its fixed
part a micro-batch: measurements.clocked_sample_s, planning/parallelism.with_fixed_cost), never from
T or a. Each row reports the share of the step the clock imposed (the busiest rank's compute,
sleeps included, over the step). The runtime's own pipeline prediction (runtime/s) sizes
stages from T and leaves a out, and has no optimizer or all-reduce: it is shown, not judged. `--clock wall` runs and
ranks every layout on the CPU's own time, and the headline reads it against host_drift.py's probe.
The figures of the last runs, with their commands and JSON, are in docs/planning.md.

Rounds (--rounds, 1 by default): each round ranks from its own probes (its own cache) and then
runs every layout (each round from a later layout on, so that the first run after the probes
is not always the same layout's: run_order), so on a host whose speed drifts in phases of seconds the predictions sample the drift
as the runs do; the median prediction is compared with the median run, memory round by
round (the table's MiB: round 0's row, the largest run), and every round's pair is in the JSON.
On the wall clock the DP and capacity rows also show `cpu run/exp`: the run's CPU a step over
its profile's, on the rank that set the step, against the stretch the ranking expected from two
devices computing on shared cores (both medians over rounds; cpu_over_probe). It is read from the
run and never given to the prediction; where the first exceeds the second by the row's error,
the miss is the CPU computing slower in the run than in the probes, not the layout's model.
The `spread` column is how far the rounds moved, predictions/runs, each (largest − least) over its
median: the runs' spread is the host's noise floor for that layout (the same plan run again), so
an error inside it is not a model's miss, and one outside it is. A row whose runs moved more than
its target is marked noisy (`quiet` false in the JSON) and the headline counts the quiet rows: on
those alone does the target judge the model rather than the host (one round: no spread, no mark).
The `host` column (wall clock) is how far the host itself had moved between a row's plan and its
run: benchmarks/host_gauge.py's two processes time the model's forward and backward together,
once at the end of each `hetrain plan` and just before and just after each run (their mean);
+ means the host computed slower in the run, and a prediction then reads fast by about as much.
It is read by this driver, never given to a prediction. `--max-host-move 0.04 --retries 2` runs
a layout again while its host had moved more than 4%, as `--max-other-cores` does for a run that
had company; every attempt is kept in the JSON (attempt_log) and the last one is compared.

Reading the figures on a shared host (other_work_cores: the CPU the rest of the host used during
the run). Data-parallel ranks are throttled by their CPU time, so other work slows them only by
what it takes from the cores. A pipeline stage is throttled by the wall time of each piece
(parallel/pipeline_stage.py: so a uniformly slowed CPU keeps the devices' ratio), so other work
that stretches a piece by x stretches the emulated device by x too, and a busy host reads as a
slower pipeline. FSDP2 runs a collective per unit and pass (all-gathers forward and backward, a
reduce-scatter): each waits for both ranks to be scheduled, which a loaded host delays. The
ranking's FSDP2 row is DP's step plus what `hetrain plan` timed an FSDP2 step beyond a DDP one
(runtime/measure/fsdp_probe.py: each rank at its data-parallel share, paced as training paces it),
so its error is DP's plus the probe's; timed at equal rows with the sleep after the step, the
excess read +117 ms where the run paid +164 (wall +15%). The TP row is a step of the split timed
by `hetrain plan` at the micro-batch the run takes (planning/tensor_split.tp_micro_batch), with
what each rank held counted there: its memory column checks that the probe ran the run's split
(it read −8.6% while the two cut the layers by different speeds), not a model of the count. Only a
quiet host's table checks the model; `--max-other-cores 0.2 --retries 3` repeats a run that
had company. Four emulated devices at speeds 1, 1, 0.67, 0.67 want 3.3 cores: on a 2-core host
use --dilate 2. Both models play out the cores being shared (the data-parallel one step by step,
cost.shared_cpu_finish; the pipelines' piece by piece, planning/core_sharing.py, with the
contention, message times and schedule overhead the pipeline probe measured: the row's detail
prints each stage's stretch and the step's).

What a pipeline row's prediction rests on, all measured by `hetrain plan`'s processes: the blocks'
costs (profile_blocks), how a stage runs them (runtime/measure/pipeline_probe.py: a factor a row, a
fixed cost a block and for the first and last parts), the host's sharing figures (above), and what
each step adds after its schedule (each stage's optimizer from the profiles, hetrain's agreement,
the replicas' all-reduce on the measured link). A replica's micro-batches are those the runtime
runs (19 samples asked in 8 run as 7 of 3: planning/pipeline_split.micro_batch_cut); costing 8 of 3
read DP×PP 2×2 7.9% slow on the clock.

    python benchmarks/plan_accuracy.py --layout all --json out.json --global-batch 32 --steps 24 --dilate 2
    python benchmarks/plan_accuracy.py --layout all --quick --json out.json     # DP and PP, both clocks
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from controlled_clock import clock_config, clock_micro_s, clock_s, describe_clock

REPO = Path(__file__).resolve().parents[1]
SPEED_TARGET, MEMORY_TARGET = 0.10, 0.15     # samples/s on the wall clock (a quiet host); peak memory
CLOCKED_SPEED_TARGET = 0.05                  # samples/s on the controlled clock
CLUSTERS = {"2dev": "a100-80g:1.0,rtx3090:0.67",
            "4dev": "a100-80g:1.0,a100-80g:1.0,rtx3090:0.67,rtx3090:0.67"}
LAYOUTS = {   # name: (cluster, prepare(parallel=...), Config.sharding, the ranking's row family)
    "dp": ("2dev", "dp", "none", "DP"),
    "fsdp": ("2dev", "dp", "fsdp", "FSDP2"),
    "capacity": ("2dev", "dp", "capacity", "DP + capacity"),
    "pp": ("2dev", "pp", "none", "PP"),
    "dp-pp": ("4dev", "dp-pp", "none", "DP×PP"),
    "tp": ("2dev", "tp", "none", "TP by speed"),      # hetrain.TensorParallel(split="speed")
}
MODEL_ENV = "HETRAIN_LAYOUT_ACCURACY_MODEL"     # "layers,d_model,seq_len": the factory's GPT
WARMUP_STEPS = 2
QUICK_LAYOUTS = ("dp", "pp")       # --quick --layout all: one data-parallel row, one pipeline row


# -- the model: the same in `hetrain plan` and in the training runs ---------------------------
def model_shape() -> tuple[int, int, int]:
    layers, d, seq = (int(v) for v in os.environ.get(MODEL_ENV, "4,128,64").split(","))
    return layers, d, seq


def factory():
    """(model, optimizer, dataset): the demo GPT on random tokens (the timing needs no text)."""
    import torch

    from hetrain.demo.gpt import GPT, GPTConfig

    layers, d, seq = model_shape()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=seq, d_model=d, n_layers=layers, n_heads=max(1, d // 32)))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4096, seq + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), data


def loss_fn(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def forward_loss(model, x, y, precision: str):
    """The factory's model's loss on (x, y) in `precision` (autocast below fp32, as training's
    precision policy runs it: runtime/devices/precision_policy.DTYPES)."""
    import contextlib

    import torch

    from hetrain.runtime.devices.precision_policy import DTYPES

    dtype = DTYPES.get(precision)
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
        return loss_fn(model(x), y)


def forward_backward(model, x, y, precision: str) -> None:
    """One forward and backward of the factory's model in `precision`, its gradients dropped: the
    unit of work host_gauge.py and host_drift.py time."""
    forward_loss(model, x, y, precision).backward()
    model.zero_grad(set_to_none=True)


_GAUGES: dict = {}


def host_reference(precision: str) -> float:
    """The host's speed now, as the devices find it (benchmarks/host_gauge.py: two processes,
    computing together, each timing one forward and backward of the factory's model): read while
    nothing of ours trains, so that its change between a plan and a run is the host's own (a
    neighbour on the hypervisor, the cores' sharing, the clock frequency), never a layout's. Read
    beside the error, never given to a prediction; with --max-host-move a run whose host moved is
    run again (run_layout)."""
    return _gauge().read(precision)


def _gauge():
    from host_gauge import HostGauge

    model = os.environ.get(MODEL_ENV, "4,128,64")
    if model not in _GAUGES:
        _GAUGES[model] = HostGauge(model, MODEL_ENV)
    return _GAUGES[model]


def close_gauges() -> None:
    for gauge in _GAUGES.values():
        gauge.close()
    _GAUGES.clear()


# -- inside each training process -------------------------------------------------------------
def worker(argv: list[str]) -> None:
    """One training job of one layout (argv: parallel, sharding, global batch, steps, precision,
    the controlled clock's seconds a sample or 'wall', its seconds a micro-batch or 'none', out)."""
    parallel, sharding, batch, steps, precision, clock, micro, out = argv
    import hetrain
    from hetrain import Emulation, Rebalancing, Reporting
    from hetrain.files import write_json_atomic

    ht = hetrain.init(global_batch=int(batch), max_steps=int(steps), seed=0, precision=precision,
                      sharding=sharding, rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False),
                      emulation=Emulation(sample_s=None if clock == "wall" else float(clock),
                                          micro_s=None if micro == "none" else float(micro)))
    model, opt, data = factory()
    layout = hetrain.TensorParallel(split="speed") if parallel == "tp" else parallel
    model, opt, batches = ht.prepare(model, opt, data, parallel=layout, loss_fn=loss_fn)
    marks = [time.perf_counter()]
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
        marks.append(time.perf_counter())
    summary = ht.summary()
    layout = ht.job.layout
    pipe = getattr(layout, "pipe", None)
    if ht.is_main:
        steady = marks[1 + WARMUP_STEPS:]
        timed = len(steady) - 1
        summary["steady_samples_per_s"] = (timed * int(batch) / (steady[-1] - steady[0])) if timed > 0 else None
        summary["step_seconds"] = [b - a for a, b in zip(marks, marks[1:])]
        if pipe is not None:
            summary["pipeline_split"] = {"sizes": list(pipe.split.sizes), "bubble": pipe.split.bubble_fraction}
        summary["planned_memory"] = [d.predicted_memory_bytes for d in ht.plan.devices]
        summary["global_batch"] = int(batch)
        summary["steady_busy_s"] = [r["busy_s"] / max(1, int(steps) - 1) for r in summary["ranks"]]
        summary["steady_compute_s"] = [r["compute_s"] / max(1, int(steps) - 1) for r in summary["ranks"]]
        write_json_atomic(out, summary)
    ht.close()


# -- the driver -------------------------------------------------------------------------------
def _env(cache: str, model: str) -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HETRAIN_CACHE": cache, MODEL_ENV: model, "COLUMNS": "160"}


def ranking_for(spec: str, args, cache: str, workdir: str, model: str) -> dict:
    """`hetrain plan --model-factory` on this cluster, then its ranking computed from what the
    job's processes measured, as cli/planning.py computes the table it prints."""
    from hetrain.runtime.layouts.ranking import model_facts      # the facts `hetrain plan` gives ModelState
    from hetrain.planning.layouts import ModelState
    from hetrain.runtime.config import Config, Emulation
    from hetrain.runtime.measure.measurements import Measurements, rank_from_measurements
    from hetrain.runtime.parallel.blocks import find_parts

    path = os.path.join(workdir, f"measured-{len(spec.split(','))}dev.json")
    cmd = [sys.executable, "-m", "hetrain", "plan", "--model-factory", f"{Path(__file__).resolve()}:factory",
           "--emulate", spec, "--global-batch", str(args.global_batch), "--precision", args.precision,
           "--measurements", path, "--json",
           # on the clock, as the runs: its profiles and FSDP2 probe are measured on it, not told it
           *(["--emulate-sample-s", repr(clock_s(args))] if clock_s(args) else []),
           *(["--emulate-micro-s", repr(clock_micro_s(args))] if clock_micro_s(args) else [])]
    proc = subprocess.run(cmd, env=_env(cache, model), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"hetrain plan failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    measured = Measurements.from_json(Path(path).read_text())
    # the ranking as a job on the controlled clock makes it (measurements.planning_profiles and
    # rank_from_measurements put the profiles and the pipeline's blocks on that clock)
    config = Config(global_batch=args.global_batch, precision=args.precision,
                    emulation=Emulation(cluster=spec, **clock_config(args)))
    os.environ[MODEL_ENV] = model
    m, opt, _ = factory()
    blocks = len(find_parts(m).blocks)
    ranking, profiles, options = rank_from_measurements(         # what `hetrain plan` ranks
        measured, config, state=ModelState(**model_facts(m, opt, blocks)))
    return {"ranking": ranking.to_dict(), "plan": json.loads(proc.stdout),
            "precision": profiles[0].precision if profiles else "fp32",    # what the probes computed in
            "pipeline": (measured.pipeline or {}).get("profile"),      # the blocks as a stage runs them
            "profiles": [p.to_dict() for p in profiles], "link_gbs": options.link.bandwidth_gbs if options.link else None}


def run_layout(name: str, spec: str, args, cache: str, workdir: str, model: str, tag: str,
               planned: dict | None = None) -> dict:
    """One training run of a layout; again (up to --retries times) while other work used more than
    --max-other-cores, while the host's speed (host_reference, read just before and just after
    the run) was more than --max-host-move from its speed at the end of `planned`'s probes, or while
    the host was slow during more than --max-host-burst of the run (host_gauge.burst_share of the
    passes HostGauge.watch timed beside it). Every attempt's figures are kept in the summary
    ("attempt_log")."""
    from host_gauge import burst_share
    from hostload import children_cpu_s, host_busy_s

    from hetrain.launch import build_launch

    _, parallel, sharding, _ = LAYOUTS[name]
    clock = clock_s(args)
    max_move = getattr(args, "max_host_move", None)
    max_burst = getattr(args, "max_host_burst", None)
    planned = planned if planned and planned.get("host_s") else None      # read on the wall clock only
    log = []
    for attempt in range(args.retries + 1):
        gauge, precision = (_gauge(), planned["precision"]) if planned else (None, None)
        before = gauge.read(precision) if gauge else None
        paced_before = gauge.read(precision, paced=True) if gauge else None
        out = os.path.join(workdir, f"{tag}-a{attempt}.json")
        launch = build_launch(target=str(Path(__file__).resolve()), emulate=spec, run_dir=os.path.join(workdir, tag),
                              target_args=("--worker", parallel, sharding, str(args.global_batch), str(args.steps),
                                           args.precision, "wall" if clock is None else repr(clock),
                                           repr(clock_micro_s(args)) if clock_micro_s(args) else "none", out))
        if gauge:
            gauge.watch()
        busy0, ours0, t0 = host_busy_s(), children_cpu_s(), time.perf_counter()
        proc = subprocess.run(list(launch.argv), env={**_env(cache, model), **launch.env}, capture_output=True,
                              text=True, timeout=900)
        wall = time.perf_counter() - t0
        others = max(0.0, (host_busy_s() - busy0) - (children_cpu_s() - ours0)) / wall
        watched = gauge.watched() if gauge else []
        if proc.returncode != 0:
            raise SystemExit(f"{tag}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads(Path(out).read_text())
        move = burst = cold = None
        if gauge:         # the host during the run against the host at the end of the plan's probes
            after = gauge.read(precision)
            move = (before + after) / 2 / planned["host_s"] - 1
            burst = burst_share(watched)
            # a pass after idling against one flat out, around the run: the devices idle between
            # their pieces (the throttle's sleeps), the plan's profiles do not
            cold = (paced_before + gauge.read(precision, paced=True)) / (before + after) - 1
        log.append({"samples_per_s": summary["steady_samples_per_s"], "other_work_cores": round(others, 3),
                    "host_move": move, "host_burst": burst, "host_cold": cold,
                    "watched_ms": [round(v, 1) for v in watched]})
        summary.update(other_work_cores=others, attempts=attempt + 1, wall_s=wall, host_move=move, host_burst=burst,
                       host_cold=cold, attempt_log=log)
        busy = args.max_other_cores is not None and others > args.max_other_cores
        moved = max_move is not None and move is not None and abs(move) > max_move
        burst_out = max_burst is not None and burst is not None and burst > max_burst
        if not (busy or moved or burst_out) or attempt == args.retries:
            break
        why = (f"other work used {others:.2f} cores during the run" if busy else
               f"the host ran {move:+.1%} against the plan's probes during the run" if moved else
               f"the host was slow during {burst:.0%} of the run")
        print(f"{tag}: {why}; again", file=sys.stderr)
        time.sleep(args.retry_wait)
    return summary


def row_of(name: str, ranking: dict, stages: int | None = None) -> dict:
    family = LAYOUTS[name][3]
    rows = [r for r in ranking["rows"] if r["family"] == family]
    if family == "PP":
        rows = [r for r in rows if r["name"] == f"PP {stages} stages"]
    elif family == "DP×PP":
        rows = [r for r in rows if r["name"].endswith(f"×{stages}")]
    if not rows:
        raise SystemExit(f"the ranking has no {family} row: {[r['name'] for r in ranking['rows']]}")
    return rows[0]


def compare(name: str, spec: str, preds: list[dict], runs: list[dict], *, clocked: bool = False) -> dict:
    """The ranking's row against the runs of its layout, round by round (preds[r]: round r's
    row, runs[r]: its run); the medians over rounds are what the targets judge."""
    pred = preds[0]
    got = statistics.median(s["steady_samples_per_s"] for s in runs)
    peaks = [max(r["ranks"][k]["peak_bytes"] for r in runs) for k in range(len(runs[0]["ranks"]))]
    pmem = [m for m in pred["memory"] if m is not None]
    predicted = statistics.median(p["samples_per_s"] for p in preds)
    # Memory round by round: a near-tied split can differ between rounds (and between the
    # ranking and the runtime), and each round's row is compared with its own run.
    mem_errors = [max(m for m in p["memory"] if m is not None) / max(k["peak_bytes"] for k in s["ranks"]) - 1
                  for p, s in zip(preds, runs) if any(m is not None for m in p["memory"])]
    row = {"layout": name, "row": pred["name"], "cluster": spec, "fits": pred["fits"],
           "predicted_samples_per_s": predicted, "measured_samples_per_s": got,
           "summary_samples_per_s": statistics.median(s["samples_per_s"] for s in runs),
           "speed_error": predicted / got - 1,
           "rounds": [{"predicted": p["samples_per_s"], "measured": s["steady_samples_per_s"],
                       "speed_error": p["samples_per_s"] / s["steady_samples_per_s"] - 1, "detail": p["detail"],
                       "pipeline_split": s.get("pipeline_split")} for p, s in zip(preds, runs)],
           "predicted_memory": pred["memory"], "measured_memory": peaks,   # round 0's row; the largest of the runs
           "predicted_peak": max(pmem) if pmem else None, "measured_peak": max(peaks),
           "step_seconds": [[round(t, 4) for t in s["step_seconds"]] for s in runs],
           "runtime_predicted_memory": runs[0].get("planned_memory"),
           "detail": pred["detail"], "shares": runs[0]["shares"], "micro_batches": runs[0]["micro_batches"],
           "other_work_cores": [round(s["other_work_cores"], 2) for s in runs],
           "attempts": [s["attempts"] for s in runs],
           # the host's speed during each round's run against the end of its plan's probes
           # (host_reference; + : the host computed slower in the run), and every attempt made
           "host_move": [s.get("host_move") for s in runs],
           # the share of each round's run during which the host itself was slow (host_gauge.burst_share)
           "host_burst": [s.get("host_burst") for s in runs],
           # a paced pass (idle as long after it) against a flat-out one, around each round's run
           "host_cold": [s.get("host_cold") for s in runs],
           "attempt_log": [s.get("attempt_log") for s in runs]}
    # how far the rounds moved, each side on its own: the runs' spread is the host's noise floor
    # for this layout (the same plan, run again), which no prediction can read better than
    row["predicted_spread"] = spread([p["samples_per_s"] for p in preds])
    row["measured_spread"] = spread([s["steady_samples_per_s"] for s in runs])
    # on the clock a piece lasts what it is told; FSDP2's forward and backward hold its own
    # collectives' CPU, which its row costs apart (the probe's excess)
    dp_family = LAYOUTS[name][1] == "dp" and LAYOUTS[name][2] != "fsdp" and not clocked
    row["cpu_over_probe"] = [cpu_over_probe(s) for s in runs] if dp_family else None
    row["cpu_stretch_expected"] = [s["predicted"].get("cpu_stretch") for s in runs] if dp_family else None
    row["memory_error"] = statistics.median(mem_errors) if mem_errors else None
    row["memory_errors"] = mem_errors
    own = [s["predicted"].get("samples_per_s") for s in runs if s.get("predicted")]
    if LAYOUTS[name][1] != "dp":
        row["runtime_predicted_samples_per_s"] = own[0] if own and own[0] else None
        row["pipeline_split"] = runs[0].get("pipeline_split")
    # the share of the step the clock set (the busiest rank's compute, sleeps included), what fails
    # the row whatever its error (an OOM the plan did not foresee, a step redone), and its target
    row["compute_share"] = statistics.median(max(s.get("steady_busy_s") or [0.0]) * s["steady_samples_per_s"]
                                             / s["global_batch"] for s in runs)
    row["imposed_share"] = row["compute_share"] if clocked else None
    row["ooms"] = [sum(int(k["ooms"]) for k in s["ranks"]) for s in runs]
    row["redone_steps"] = [int(s.get("redone_steps", 0)) for s in runs]
    row["fail"] = "; ".join(filter(None, [f"{sum(row['ooms'])} unplanned OOM(s)" if any(row["ooms"]) else "",
                                          f"{sum(row['redone_steps'])} redone step(s)" if any(row["redone_steps"]) else ""]))
    target = CLOCKED_SPEED_TARGET if clocked else SPEED_TARGET
    row["speed_target"] = target
    row["pass"] = not row["fail"] and abs(row["speed_error"]) <= target and (
        row["memory_error"] is None or abs(row["memory_error"]) <= MEMORY_TARGET)
    # the same plan, run again rounds apart, moved more than the target: no prediction can be
    # checked against this host to the target (the error is the host's as much as the model's;
    # the predictions, each from its round's probes, move too: predicted_spread, shown beside)
    row["quiet"] = None if row["measured_spread"] is None else row["measured_spread"] <= target
    return row


def cpu_over_probe(run: dict) -> float | None:
    """A data-parallel run's CPU a step over what its profile says that CPU is, on the rank that
    set the step (the most busy time, sleeps included): read from the run's own forwards and
    backwards (the thread's CPU time the hooks count, devices/hooks.py). Shown beside the error,
    never given to the prediction. The profile times each device alone; the ranking expects
    `cpu_stretch` (the plan's predicted figure) from two devices computing at once on shared
    cores and caches; beyond that, the host computed slower during the run than during the probes
    (drift, other work), or sharing cost more than the probe measured."""
    from hetrain.planning.cost import Assignment
    from hetrain.planning.profile import DeviceProfile

    ratios = []
    for r, p in enumerate(run.get("profiles") or []):
        share, micro = run["shares"][r], run["micro_batches"][r]
        if not share or not micro or not p.get("cpu_share"):
            continue
        # the planner's own cost of this share (its seconds on the device), as CPU seconds
        profile = DeviceProfile.from_dict(p)
        planned = Assignment(profile=profile, share=share, micro_batch=micro).compute_s(
            ddp_cost=(run.get("predicted") or {}).get("ddp_cost", 1.0)) * profile.cpu_share
        ratios.append((run["steady_compute_s"][r] / planned, run["steady_busy_s"][r]))
    return max(ratios, key=lambda t: t[1])[0] if ratios else None


def spread(values: list[float]) -> float | None:
    """(largest − least) / median of the rounds' figures (None: a single round)."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def main(args, chosen: list[str], clocks: list | None = None) -> dict:
    """Every chosen layout on every clock (plan_accuracy.py's resolve_clocks; default the one in
    `args`), interleaved round by round; exits 1 when a row failed (an unplanned OOM, a redone step)."""
    clocks = clocks or [args]
    result = {"clocks": {}}
    with tempfile.TemporaryDirectory(prefix="hetrain-layout-accuracy-") as work:
        per = {c.clock: {"runs": {n: [] for n in chosen}, "rankings": {}} for c in clocks}
        for r in range(args.rounds):
            for c in clocks:
                _round(c, chosen, r, os.path.join(work, c.clock), per[c.clock])
        close_gauges()
        for c in clocks:
            result["clocks"][c.clock] = _rows(c, chosen, per[c.clock])
    drift = drift_matmul = None
    if getattr(args, "drift_s", 0) > 0:
        from host_drift import probe_drift

        # the model's own forward+backward, in the precision the plans' probes computed in: the
        # matmuls host_drift.py times by default can read the host steadier than this model finds it
        precisions = [rk["precision"] for c in clocks if not clock_s(c)
                      for rks in per[c.clock]["rankings"].values() for rk in rks]
        drift = probe_drift(seconds=args.drift_s, model=(args.model, precisions[0] if precisions else "fp32"))
        drift_matmul = probe_drift(seconds=args.drift_s)
    from hetrain.hardware.host import host_facts

    host = host_facts()
    result.update({"model": f"demo GPT (layers, d_model, seq = {args.model}), AdamW, random tokens",
                   "host": host.to_dict(), "host_summary": host.describe(), "load_average": os.getloadavg(),
                   "global_batch": args.global_batch, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                   "rounds": args.rounds, "dilate": args.dilate, "host_drift": drift,
                   "host_drift_matmul": drift_matmul,
                   "targets": {"speed_clocked": CLOCKED_SPEED_TARGET, "speed_wall": SPEED_TARGET,
                               "memory": MEMORY_TARGET},
                   "load_note": "other_work_cores: CPU the rest of the host used during each run (near 0 on a quiet host)"})
    result["failed_rows"] = [f"{k}: {r['layout']} ({r['fail']})" for k, v in result["clocks"].items()
                             for r in v["layouts"] if r["fail"]]
    Path(args.json).write_text(json.dumps(result, indent=2))
    for v in result["clocks"].values():
        print(f"-- clock {v['clock']}")
        print(table(v["layouts"]))
    print(headline(result))
    if result["failed_rows"]:
        print("FAILED: " + "; ".join(result["failed_rows"]), file=sys.stderr)
        raise SystemExit(1)
    return result


def _round(clock, chosen: list[str], r: int, work: str, into: dict) -> None:
    """Round r on one clock: rank from its own probes (its own cache), then run every layout."""
    from hostload import dilate
    from plan_accuracy import round_cache

    os.makedirs(work, exist_ok=True)
    clusters = {k: dilate(v, clock.dilate) for k, v in CLUSTERS.items()}
    cache = round_cache(work, r)
    for key in dict.fromkeys(LAYOUTS[n][0] for n in chosen):
        found = ranking_for(clusters[key], clock, cache, work, clock.model)
        # on the wall clock, the host's speed at the end of the probes (the plan's phase)
        found["host_s"] = None if clock_s(clock) else host_reference(found["precision"])
        into["rankings"].setdefault(key, []).append(found)
    for n in run_order(chosen, r, clock.rounds):
        key = LAYOUTS[n][0]
        into["runs"][n].append(run_layout(n, clusters[key], clock, cache, work, clock.model, f"{n}-r{r}",
                                          planned=into["rankings"][key][-1]))


def run_order(chosen: list[str], r: int, rounds: int) -> list[str]:
    """Round r of `rounds` runs the layouts round the list from an offset spread over the rounds
    (3 rounds of 6 layouts: from the 1st, the 3rd, the 5th), so that the first run after the
    plans' probes is not always the same layout's: in the fixed order DP always was, and DP + capacity,
    the same plan, read a median 7.9% faster than DP over 7 such runs (docs/planning.md; whether
    the order causes it is not settled)."""
    n = len(chosen)
    k = (r * n // max(1, rounds)) % n if n else 0
    return chosen[k:] + chosen[:k]


def _rows(clock, chosen: list[str], got: dict) -> dict:
    from hostload import dilate

    rows = []
    for n in chosen:
        key = LAYOUTS[n][0]
        stages = 2 if LAYOUTS[n][1] != "dp" else None
        preds = [row_of(n, rk["ranking"], stages) for rk in got["rankings"][key]]
        rows.append(compare(n, dilate(CLUSTERS[key], clock.dilate), preds, got["runs"][n], clocked=bool(clock_s(clock))))
    return {"clock": describe_clock(clock), "clocked": bool(clock_s(clock)), "layouts": rows,
            "rankings": got["rankings"],
            "max_speed_error": max((abs(r["speed_error"]) for r in rows), default=None),
            "quiet_rows": sum(r["quiet"] is True for r in rows),
            "target": CLOCKED_SPEED_TARGET if clock_s(clock) else SPEED_TARGET}


def headline(result: dict) -> str:
    """The clocked error beside the wall clock's, and the host's drift the latter reads against."""
    parts = []
    for v in result["clocks"].values():
        err = v["max_speed_error"]
        kind = "clocked" if v["clocked"] else "wall"
        parts.append(f"{kind} max samples/s error {err:.1%} (target {v['target']:.0%})" if err is not None
                     else f"{kind}: -")
        spreads = [r["measured_spread"] for r in v["layouts"] if r.get("measured_spread") is not None]
        quiet = sum(r.get("quiet") is True for r in v["layouts"])
        if spreads:
            parts.append(f"{kind}: the runs of one plan moved {min(spreads):.0%}-{max(spreads):.0%} round to round, "
                         f"within the target on {quiet} of {len(v['layouts'])} rows"
                         + ("" if quiet == len(v["layouts"]) else
                            " (a row whose runs moved more is marked noisy: the host, not only its model, sets its error)"))
    moves = [m for v in result["clocks"].values() if not v["clocked"] for r in v["layouts"]
             for m in r.get("host_move") or [] if m is not None]
    if moves:
        parts.append(f"the host's speed in the wall-clock runs against their plans' probes: {min(moves):+.1%} "
                     f"to {max(moves):+.1%} (host_reference)")
    colds = [c for v in result["clocks"].values() if not v["clocked"] for r in v["layouts"]
             for c in r.get("host_cold") or [] if c is not None]
    if colds:
        parts.append(f"a pass after as long idle {min(colds):+.1%} to {max(colds):+.1%} against one flat out, "
                     f"around the runs")
    bursts = [b for v in result["clocks"].values() if not v["clocked"] for r in v["layouts"]
              for b in r.get("host_burst") or [] if b is not None]
    if bursts:
        parts.append(f"the host slow during {min(bursts):.0%} to {max(bursts):.0%} of a run (host_gauge.burst_share)")
    drift = result.get("host_drift")
    if drift:
        parts.append(f"host drift: a {drift['window_s']:g}-s probe of {drift['procs']} processes off its phase's "
                     f"mean by up to {drift['probe_error_max']:.1%} (median {drift['probe_error_median']:.1%}) "
                     f"timing {drift.get('workload', 'fp32 512x512 matmuls')}")
    matmul = result.get("host_drift_matmul")
    if matmul:
        parts.append(f"{matmul['workload']} up to {matmul['probe_error_max']:.1%} "
                     f"(median {matmul['probe_error_median']:.1%})")
    parts.append(f"load average {result['load_average'][0]:.2f}")
    return "; ".join(parts)


def table(rows: list[dict]) -> str:
    def mib(b):
        return f"{b / 2**20:.2f}" if b else "-"

    def pct(e):
        return f"{e:+.1%}" if e is not None else "-"

    def cpu(r):
        got, expected = r.get("cpu_over_probe"), r.get("cpu_stretch_expected")
        got = [g for g in got or [] if g is not None]
        if not got:
            return "-"
        want = [e for e in expected or [] if e is not None]
        return f"{statistics.median(got):.2f}" + (f"/{statistics.median(want):.2f}" if want else "")

    def host(r):
        moves = [m for m in r.get("host_move") or [] if m is not None]
        return f"{statistics.median(moves):+.0%}" if moves else "-"

    def cold(r):
        c = [v for v in r.get("host_cold") or [] if v is not None]
        return f"{statistics.median(c):+.0%}" if c else "-"

    def burst(r):       # the most of a round's run during which the host was slow
        shares = [b for b in r.get("host_burst") or [] if b is not None]
        return f"{max(shares):.0%}" if shares else "-"

    def spreads(r):
        p, m = r.get("predicted_spread"), r.get("measured_spread")
        return "-" if p is None or m is None else f"{p:.0%}/{m:.0%}"

    head = (f"{'layout':<10}{'row':<14}{'pred/s':>8}{'meas/s':>8}{'err':>8}{'spread':>9}{'imposed':>8}{'runtime/s':>10}"
            f"{'cpu run/exp':>12}{'host':>6}{'cold':>6}{'burst':>6}{'pred MiB':>9}{'meas MiB':>9}{'err':>8}  {'other cores':<19}result")
    lines = [head]
    for r in rows:
        own = r.get("runtime_predicted_samples_per_s")
        imposed = f"{r['imposed_share']:.0%}" if r["imposed_share"] else "-"
        verdict = f"FAIL: {r['fail']}" if r["fail"] else "PASS" if r["pass"] else "MISS"
        if r.get("quiet") is False:
            verdict += f" (noisy: runs {r['measured_spread']:.0%} apart)"
        lines.append(f"{r['layout']:<10}{r['row']:<14}{r['predicted_samples_per_s']:>8.1f}"
                     f"{r['measured_samples_per_s']:>8.1f}{pct(r['speed_error']):>8}{spreads(r):>9}{imposed:>8}"
                     f"{(f'{own:.1f}' if own else '-'):>10}{cpu(r):>12}{host(r):>6}{cold(r):>6}{burst(r):>6}"
                     f"{mib(r['predicted_peak']):>9}{mib(r['measured_peak']):>9}"
                     f"{pct(r['memory_error']):>8}  {str(r['other_work_cores']):<19}{verdict}")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(sys.argv[2:])
