"""How well does the planner predict? Rank every layout, run each for real, compare.

Each round, `hetrain plan --model-factory THIS_FILE:factory --measurements M.json` measures the model
on each emulated cluster (profiles cached in HETRAIN_CACHE) and the layout ranking is computed from
M.json as `hetrain plan` computes it; then a training run of each layout follows from the same
cache, so it runs the split the ranking costed. Compared: samples/s (rank 0 times every step, the
first two left out) and the largest device's peak memory (the emulated meter's). Rows (`all`): DP,
FSDP2, DP + capacity, a 2-stage pipeline and TP by speed on a 1 : 0.67 pair, DP×PP 2×2 on four
devices; on request the planner's DP plan on a pair whose slow card is capped (`dp-capped`: many
small micro-batches, each paying the clock's fixed part) and on three devices (`dp-3dev`).

Clocks (benchmarks/_common.py; docs/planning.md says why only one gates): on the controlled clock
(`auto`, the default) every row within 5% (median of the rounds) and its peak memory within 15%,
else exit 1; the wall clock (`--clock wall`, or `auto,wall`, interleaved) is reported beside the
runs' own spread and never gates. An OOM the plan did not foresee, or a redone step, fails a row on
either clock. --dilate 2 (the default) runs every device twice slower, so DP×PP fits a 2-core host.

    python benchmarks/accuracy.py --json out.json [--smoke]      # controlled clock, every layout, 3 rounds
    python benchmarks/accuracy.py --clock auto,wall --json out.json
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import (Parser, add_clock_arguments, add_smoke, apply_smoke, clock_config, clock_micro_s, clock_s,
                     describe_clock, dilate, resolve_clocks, train_steps)

REPO = Path(__file__).resolve().parents[1]
SPEED_TARGET, MEMORY_TARGET = 0.05, 0.15     # samples/s on the controlled clock (gated); peak memory
CLUSTERS = {"2dev": "a100-80g:1.0,rtx3090:0.67",
            "4dev": "a100-80g:1.0,a100-80g:1.0,rtx3090:0.67,rtx3090:0.67",
            "2dev-capped": "a100-80g:1.0,t4:0.35@24MiB",
            "3dev": "a100-80g:1.0,rtx3090:0.67,v100-32g:0.5"}
LAYOUTS = {   # name: (cluster, prepare(parallel=...), DataParallel's sharding, the ranking's row family)
    "dp": ("2dev", "dp", "none", "DP"),
    "fsdp": ("2dev", "dp", "fsdp", "FSDP2"),
    "capacity": ("2dev", "dp", "capacity", "DP + capacity"),
    "pp": ("2dev", "pp", "none", "PP"),
    "dp-pp": ("4dev", "dp-pp", "none", "DP×PP"),
    "tp": ("2dev", "tp", "none", "TP by speed"),      # hetrain.TensorParallel(split="speed")
    "dp-capped": ("2dev-capped", "dp", "none", "DP"),
    "dp-3dev": ("3dev", "dp", "none", "DP"),
}
ALL = ("dp", "fsdp", "capacity", "pp", "dp-pp", "tp")
MODEL_ENV = "HETRAIN_ACCURACY_MODEL"     # "layers,d_model,seq_len": the factory's GPT
WARMUP_STEPS = 2


# -- the model: the same in `hetrain plan` and in the training runs ---------------------------
def factory():
    """(model, optimizer, dataset): the demo GPT on random tokens (the timing needs no text)."""
    import torch

    from hetrain.demo.gpt import GPT, GPTConfig

    layers, d, seq = (int(v) for v in os.environ.get(MODEL_ENV, "4,128,64").split(","))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=seq, d_model=d, n_layers=layers, n_heads=max(1, d // 32)))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4096, seq + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), data


def loss_fn(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def worker(argv: list[str]) -> None:
    """One training job of one layout (argv: parallel, sharding, global batch, steps, precision,
    the clock's seconds a sample or 'wall', its seconds a micro-batch or 'none', out)."""
    parallel, sharding, batch, steps, precision, clock, micro, out = argv
    import hetrain
    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.files import write_json_atomic

    ht = hetrain.init(global_batch=int(batch), max_steps=int(steps), seed=0, precision=precision,
                      rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False),
                      emulation=Emulation(sample_s=None if clock == "wall" else float(clock),
                                          micro_s=None if micro == "none" else float(micro)))
    model, opt, data = factory()
    layout = hetrain.TensorParallel(split="speed") if parallel == "tp" else \
        hetrain.DataParallel(sharding=sharding) if parallel == "dp" else parallel
    model, opt, batches = ht.prepare(model, opt, data, parallel=layout, loss_fn=loss_fn)
    marks, _ = train_steps(ht, batches)
    summary = ht.summary()
    pipe = getattr(ht.job.layout, "pipe", None)
    if ht.is_main:
        steady = marks[1 + WARMUP_STEPS:]
        timed = len(steady) - 1
        summary.update(steady_samples_per_s=(timed * int(batch) / (steady[-1] - steady[0])) if timed > 0 else None,
                       step_seconds=[b - a for a, b in zip(marks, marks[1:])], global_batch=int(batch),
                       steady_busy_s=[r["busy_s"] / max(1, int(steps) - 1) for r in summary["ranks"]])
        if pipe is not None:
            summary["pipeline_split"] = {"sizes": list(pipe.split.sizes), "bubble": pipe.split.bubble_fraction}
        write_json_atomic(out, summary)
    ht.close()


# -- the driver -------------------------------------------------------------------------------
def _env(cache: str, model: str) -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HETRAIN_CACHE": cache, MODEL_ENV: model, "COLUMNS": "160"}


def ranking_for(spec: str, args, cache: str, workdir: str) -> dict:
    """`hetrain plan --model-factory` on this cluster, then its ranking computed from what the
    job's processes measured, as `hetrain plan` computes the table it prints."""
    from hetrain.planning.ranking import ModelState
    from hetrain.runtime.config import Config, Emulation
    from hetrain.runtime.layouts.ranking import model_facts
    from hetrain.runtime.measure.measurements import Measurements, rank_from_measurements
    from hetrain.runtime.layouts.pipeline.blocks import find_parts

    path = os.path.join(workdir, f"measured-{len(spec.split(','))}dev-{abs(hash(spec))}.json")
    cmd = [sys.executable, "-m", "hetrain", "plan", "--model-factory", f"{Path(__file__).resolve()}:factory",
           "--emulate", spec, "--global-batch", str(args.global_batch), "--precision", args.precision,
           "--measurements", path, "--json",
           # on the clock, as the runs: its profiles and probes are measured on it, not told it
           *(["--emulate-sample-s", repr(clock_s(args))] if clock_s(args) else []),
           *(["--emulate-micro-s", repr(clock_micro_s(args))] if clock_micro_s(args) else [])]
    proc = subprocess.run(cmd, env=_env(cache, args.model), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"hetrain plan failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    measured = Measurements.from_json(Path(path).read_text())
    config = Config(global_batch=args.global_batch, precision=args.precision,
                    emulation=Emulation(cluster=spec, **clock_config(args)))
    os.environ[MODEL_ENV] = args.model
    m, opt, _ = factory()
    ranking, _, _ = rank_from_measurements(
        measured, config, state=ModelState(**model_facts(m, opt, len(find_parts(m).blocks))))
    return ranking.to_dict()


def run_layout(name: str, spec: str, args, cache: str, workdir: str, tag: str) -> dict:
    """One training run of a layout: rank 0's summary."""
    from hetrain.launch import build_launch

    _, parallel, sharding, _ = LAYOUTS[name]
    out = os.path.join(workdir, f"{tag}.json")
    launch = build_launch(target=str(Path(__file__).resolve()), emulate=spec, run_dir=os.path.join(workdir, tag),
                          target_args=("--worker", parallel, sharding, str(args.global_batch), str(args.steps),
                                       args.precision, repr(clock_s(args)) if clock_s(args) else "wall",
                                       repr(clock_micro_s(args)) if clock_micro_s(args) else "none", out))
    proc = subprocess.run(list(launch.argv), env={**_env(cache, args.model), **launch.env}, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        said = Path(workdir, tag, "error-rank0.json")       # a rank's own error, as the job recorded it
        why = json.loads(said.read_text()) if said.is_file() else {"what": proc.stderr[-3000:], "fix": ""}
        raise SystemExit(f"{tag}: the run failed (exit {proc.returncode}): {why['what']}; {why['fix']}")
    return json.loads(Path(out).read_text())


def row_of(name: str, ranking: dict) -> dict:
    family = LAYOUTS[name][3]
    rows = [r for r in ranking["rows"] if r["family"] == family]
    if family == "PP":
        rows = [r for r in rows if r["name"] == "PP 2 stages"]
    elif family == "DP×PP":
        rows = [r for r in rows if r["name"].endswith("×2")]
    if not rows:
        raise SystemExit(f"the ranking has no {family} row: {[r['name'] for r in ranking['rows']]}")
    return rows[0]


def spread(values: list[float]) -> float | None:
    """(largest − least) / median of the rounds' figures (None: a single round)."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def compare(name: str, spec: str, preds: list[dict], runs: list[dict], *, clocked: bool) -> dict:
    """The ranking's row against the runs of its layout, round by round (preds[r]: round r's
    row, runs[r]: its run); the medians over rounds are what the targets judge."""
    got = statistics.median(s["steady_samples_per_s"] for s in runs)
    predicted = statistics.median(p["samples_per_s"] for p in preds)
    peaks = [max(r["ranks"][k]["peak_bytes"] for r in runs) for k in range(len(runs[0]["ranks"]))]
    pmem = [m for m in preds[0]["memory"] if m is not None]
    # memory round by round: a near-tied split can differ between rounds, each against its own run
    mem_errors = [max(m for m in p["memory"] if m is not None) / max(k["peak_bytes"] for k in s["ranks"]) - 1
                  for p, s in zip(preds, runs) if any(m is not None for m in p["memory"])]
    row = {"layout": name, "row": preds[0]["name"], "cluster": spec, "fits": preds[0]["fits"],
           "predicted_samples_per_s": predicted, "measured_samples_per_s": got, "speed_error": predicted / got - 1,
           "predicted_spread": spread([p["samples_per_s"] for p in preds]),
           "measured_spread": spread([s["steady_samples_per_s"] for s in runs]),
           "rounds": [{"predicted": p["samples_per_s"], "measured": s["steady_samples_per_s"],
                       "speed_error": p["samples_per_s"] / s["steady_samples_per_s"] - 1, "detail": p["detail"],
                       "pipeline_split": s.get("pipeline_split")} for p, s in zip(preds, runs)],
           "predicted_memory": preds[0]["memory"], "measured_memory": peaks,
           "predicted_peak": max(pmem) if pmem else None, "measured_peak": max(peaks),
           "memory_error": statistics.median(mem_errors) if mem_errors else None, "memory_errors": mem_errors,
           "step_seconds": [[round(t, 4) for t in s["step_seconds"]] for s in runs],
           "detail": preds[0]["detail"], "shares": runs[0]["shares"], "micro_batches": runs[0]["micro_batches"],
           # the share of the step the clock set (the busiest rank's compute, sleeps included)
           "compute_share": statistics.median(max(s.get("steady_busy_s") or [0.0]) * s["steady_samples_per_s"]
                                              / s["global_batch"] for s in runs),
           "ooms": [sum(int(k["ooms"]) for k in s["ranks"]) for s in runs],
           "redone_steps": [int(s.get("redone_steps", 0)) for s in runs]}
    own = [s["predicted"].get("samples_per_s") for s in runs if s.get("predicted")]
    if LAYOUTS[name][1] != "dp":      # the runtime's own pipeline or TP prediction: shown, not judged
        row["runtime_predicted_samples_per_s"] = own[0] if own and own[0] else None
    row["imposed_share"] = row["compute_share"] if clocked else None
    row["fail"] = "; ".join(filter(None, [f"{sum(row['ooms'])} unplanned OOM(s)" if any(row["ooms"]) else "",
                                          f"{sum(row['redone_steps'])} redone step(s)" if any(row["redone_steps"]) else ""]))
    row["gated"] = clocked
    row["pass"] = not row["fail"] and (not clocked or abs(row["speed_error"]) <= SPEED_TARGET) and (
        row["memory_error"] is None or abs(row["memory_error"]) <= MEMORY_TARGET)
    return row


def run_order(chosen: list[str], r: int, rounds: int) -> list[str]:
    """Round r of `rounds` runs the layouts round the list from an offset spread over the rounds
    (3 rounds of 6: from the 1st, the 3rd, the 5th), so the first run after the plans' probes is
    not always the same layout's."""
    n = len(chosen)
    k = (r * n // max(1, rounds)) % n if n else 0
    return chosen[k:] + chosen[:k]


def _round(clock, chosen: list[str], r: int, work: str, into: dict) -> None:
    """Round r on one clock: rank from its own probes (its own cache; the host facts carried
    over from round 0), then run every layout."""
    os.makedirs(work, exist_ok=True)
    cache = os.path.join(work, f"cache-r{r}")
    first = os.path.join(work, "cache-r0", "host")
    if r > 0 and os.path.isdir(first):
        shutil.copytree(first, os.path.join(cache, "host"), dirs_exist_ok=True)
    for key in dict.fromkeys(LAYOUTS[n][0] for n in chosen):
        into["rankings"].setdefault(key, []).append(ranking_for(dilate(CLUSTERS[key], clock.dilate), clock, cache, work))
    for n in run_order(chosen, r, clock.rounds):
        spec = dilate(CLUSTERS[LAYOUTS[n][0]], clock.dilate)
        into["runs"][n].append(run_layout(n, spec, clock, cache, work, f"{n}-r{r}"))


def main(argv=None) -> dict:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--layouts", default=None,
                   help=f"comma-separated, of {', '.join(LAYOUTS)}, or all (default: all = {', '.join(ALL)})")
    p.add_argument("--steps", type=int, default=24, help="steps a run, the first two untimed (default 24)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each from its own probes (default 3)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--model", default="4,128,64", help="the demo GPT's layers,d_model,seq_len")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default): each card's own, computed in fp32 where this CPU runs it slowly")
    p.add_argument("--dilate", type=float, default=2.0, help="run every emulated device D times slower (default 2)")
    add_clock_arguments(p, default="auto", micro=True)
    add_smoke(p)
    args = p.parse_args(argv)
    apply_smoke(p, args, steps=4, rounds=1, global_batch=32, model="2,64,16", precision="fp32", dilate=1.0)
    names = [n.strip() for n in (args.layouts or ("dp" if args.smoke else "all")).split(",") if n.strip()]
    chosen = list(dict.fromkeys(k for n in names for k in (ALL if n == "all" else [n])))
    unknown = [n for n in chosen if n not in LAYOUTS]
    if unknown or not chosen:
        p.error(f"--layouts {args.layouts}: unknown {', '.join(unknown) or 'none given'}; "
                f"known: {', '.join(LAYOUTS)}, all")
    if args.steps < WARMUP_STEPS + 2 or args.rounds < 1 or args.global_batch < 4 or args.dilate < 1:
        p.error(f"--steps {args.steps}, --rounds {args.rounds}, --global-batch {args.global_batch}, --dilate "
                f"{args.dilate:g}: give at least {WARMUP_STEPS + 2} steps, 1 round, a batch of 4, a dilation of 1")
    try:
        args.layers, args.d_model, args.seq_len = (int(v) for v in args.model.split(","))
    except ValueError:
        p.error(f"--model {args.model!r}: give layers,d_model,seq_len (e.g. 4,128,64)")
    sys.path.insert(0, str(REPO / "src"))
    clocks = resolve_clocks(args, p, micro_batch=max(1, round(args.global_batch / 1.67)))
    result = {"clocks": {}}
    with tempfile.TemporaryDirectory(prefix="hetrain-accuracy-") as work:
        per = {c.clock: {"runs": {n: [] for n in chosen}, "rankings": {}} for c in clocks}
        for r in range(args.rounds):          # interleaved, so the host's drift hits every clock alike
            for c in clocks:
                _round(c, chosen, r, os.path.join(work, c.clock), per[c.clock])
        for c in clocks:
            rows = [compare(n, dilate(CLUSTERS[LAYOUTS[n][0]], c.dilate),
                            [row_of(n, rk) for rk in per[c.clock]["rankings"][LAYOUTS[n][0]]],
                            per[c.clock]["runs"][n], clocked=bool(clock_s(c))) for n in chosen]
            result["clocks"][c.clock] = {"clock": describe_clock(c), "clocked": bool(clock_s(c)), "layouts": rows,
                                         "rankings": per[c.clock]["rankings"],
                                         "max_speed_error": max(abs(r["speed_error"]) for r in rows)}
    from hetrain.hardware.host import host_facts

    host = host_facts()
    result.update({"model": f"demo GPT (layers, d_model, seq = {args.model}), AdamW, random tokens",
                   "host": host.to_dict(), "host_summary": host.describe(), "load_average": os.getloadavg(),
                   "global_batch": args.global_batch, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                   "rounds": args.rounds, "dilate": args.dilate, "smoke": args.smoke,
                   "targets": {"speed_clocked": SPEED_TARGET, "memory": MEMORY_TARGET}})
    rows = [(k, r) for k, v in result["clocks"].items() for r in v["layouts"]]
    result["failed_rows"] = [f"{k}: {r['layout']} ({r['fail']})" for k, r in rows if r["fail"]]
    result["missed_rows"] = [f"{k}: {r['layout']}" for k, r in rows if not r["fail"] and not r["pass"]]
    Path(args.json).write_text(json.dumps(result, indent=2))
    for v in result["clocks"].values():
        print(f"-- clock {v['clock']}")
        print(table(v["layouts"]))
    print(headline(result))
    if result["failed_rows"] or (result["missed_rows"] and not args.smoke):     # a smoke's sizes judge nothing
        print("FAILED: " + "; ".join(result["failed_rows"] + result["missed_rows"]), file=sys.stderr)
        raise SystemExit(1)
    return result


def headline(result: dict) -> str:
    """The gated clocked error, then the wall clock's beside the runs' own spread."""
    parts = []
    for v in result["clocks"].values():
        err = v["max_speed_error"]
        spreads = [r["measured_spread"] for r in v["layouts"] if r.get("measured_spread") is not None]
        if v["clocked"]:
            verdict = "within" if err <= SPEED_TARGET else "OVER"
            parts.append(f"clocked: max samples/s error {err:.1%} over {len(v['layouts'])} rows ({verdict} the "
                         f"{SPEED_TARGET:.0%} target, gated)")
        else:
            parts.append(f"wall: max samples/s error {err:.1%} (not gated)"
                         + (f", the runs of one plan moved {min(spreads):.0%}-{max(spreads):.0%} round to round "
                            f"(median {statistics.median(spreads):.0%})" if spreads else ", one round: no spread"))
    if result.get("smoke"):
        parts.append("smoke sizes: the code path checked, not the figures")
    return "; ".join(parts + [f"load average {result['load_average'][0]:.2f}"])


def table(rows: list[dict]) -> str:
    def mib(b):
        return f"{b / 2**20:.2f}" if b else "-"

    def pct(e):
        return f"{e:+.1%}" if e is not None else "-"

    def spreads(r):
        p, m = r.get("predicted_spread"), r.get("measured_spread")
        return "-" if p is None or m is None else f"{p:.0%}/{m:.0%}"

    lines = [f"{'layout':<10}{'row':<14}{'pred/s':>8}{'meas/s':>8}{'err':>8}{'spread':>9}{'imposed':>8}"
             f"{'runtime/s':>10}{'pred MiB':>9}{'meas MiB':>9}{'err':>8}  result"]
    for r in rows:
        own = r.get("runtime_predicted_samples_per_s")
        imposed = f"{r['imposed_share']:.0%}" if r["imposed_share"] else "-"
        verdict = (f"FAIL: {r['fail']}" if r["fail"] else ("PASS" if r["pass"] else "MISS")
                   + ("" if r["gated"] else " (not gated)"))
        lines.append(f"{r['layout']:<10}{r['row']:<14}{r['predicted_samples_per_s']:>8.1f}"
                     f"{r['measured_samples_per_s']:>8.1f}{pct(r['speed_error']):>8}{spreads(r):>9}{imposed:>8}"
                     f"{(f'{own:.1f}' if own else '-'):>10}{mib(r['predicted_peak']):>9}{mib(r['measured_peak']):>9}"
                     f"{pct(r['memory_error']):>8}  {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
