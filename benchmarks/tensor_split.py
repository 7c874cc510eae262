"""Tensor parallelism split by speed against the even split, on an emulated 1 : 0.6 pair.

A Hugging Face GPT-2 (built from a config: no downloads; 8 heads, dropout off) trained with
`parallel=hetrain.TensorParallel(split=...)` on an emulated A100 (1.0) and RTX 3090 (0.6):
  tp-even    every layer cut in half (4/4 heads)
  tp-speed   heads and MLP columns by speed (5/3 heads, 320/192 columns)
and, with --fast-pair, tp-even on two A100s (the ceiling). A run's throughput is the global batch
over its median step; each figure the median over interleaved rounds of the ratio within a round.

Clock: controlled by default (benchmarks/_common.py): a micro-batch of m samples on a TP rank lasts
m·T·share/speed, `share` its part of the Linear weights, T 8× the whole model's forward+backward
CPU time a sample here (at 3× a TP rank's DTensor and gloo overheads made the even split
CPU-bound); `clock_only` is the ratio the clock alone gives. `--clock wall`: the CPU's time.

    PYTHONPATH=src python benchmarks/tensor_split.py --json out.json [--rounds 3] [--steps 8] [--fast-pair] [--smoke]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

from _common import (Parser, add_sizes, add_smoke, add_worker_args, apply_smoke, clock_s, flags, hf_gpt2,
                     launched, resolve_clock, torchrun)

FAST, SLOW = "a100-80g:1.0", "rtx3090:0.6"
CONFIGS = {   # name: (TensorParallel's split, cluster spec)
    "tp-even": ("even", f"{FAST},{SLOW}"),
    "tp-speed": ("speed", f"{FAST},{SLOW}"),
    "tp-even-fast-pair": ("even", f"{FAST},{FAST}"),
}


def gpt2(args):
    """The benchmark's GPT-2 (seeded) and its byte windows of the pydoc text."""
    import torch

    from hetrain.demo.text import ByteWindows, pydoc_bytes

    torch.manual_seed(0)
    model = hf_gpt2(vocab_size=256, n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.layers,
                    n_head=args.heads, attn_implementation="sdpa")
    return model, ByteWindows(pydoc_bytes(), args.seq_len)


def loss_of(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())


def calibrate_clock_ms(args) -> tuple[float, float]:
    """(T in ms, the CPU ms a sample it comes from): the whole model's forward + backward CPU time
    a sample, one thread, at the global batch (median of 6 steps after 2), ×8 rounded up to 0.5 ms."""
    from _common import cpu_ms_per_sample

    model, data = gpt2(args)
    cpu_ms = cpu_ms_per_sample(model, data, args.global_batch, loss_of, steps=6, skip=2)
    return math.ceil(8 * cpu_ms * 2) / 2, cpu_ms


# -- inside each worker process ----------------------------------------------------------------
def worker(args) -> dict:
    import torch

    import hetrain
    from hetrain import Reporting
    from hetrain.emulation import Emulation
    from hetrain.benching.worker import timed_steps  # `hetrain bench`'s timed loop

    torch.set_num_threads(1)
    ends: list[float] = []
    ht = hetrain.init(global_batch=args.global_batch, precision="fp32", max_steps=args.warmup + args.steps,
                      emulation=Emulation(cluster=args.spec, sample_s=clock_s(args)),
                      reporting=Reporting(verbose=False))
    model, data = gpt2(args)
    model, _, batches = ht.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data,
                                     parallel=hetrain.TensorParallel(split=args.split))
    seconds = timed_steps(ht, model, batches, warmup=args.warmup, loss=lambda m, batch: loss_of(m, *batch),
                          on_step=lambda step: ends.append(time.perf_counter()))
    steps = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])]
    throttle = ht.emulated.throttle        # this rank's clock: T x its share of the model's Linears
    got = {"samples_per_s": args.steps * args.global_batch / seconds, "step_s": steps,
           "speeds": [round(d.speed, 3) for d in ht.plan.devices],
           "micro_batch": [d.micro_batch for d in ht.plan.devices],
           "clock_s_per_sample": throttle.sample_s / throttle.speed if throttle.sample_s else None}
    ht.close()
    return got


# -- the driver --------------------------------------------------------------------------------
def launch(name: str, args) -> dict:
    split, spec = CONFIGS[name]
    ranks = torchrun(__file__, 2, ["--worker", "--split", split, "--spec", spec, *flags(
        args, "steps", "warmup", "global_batch", "seq_len", "d_model", "layers", "heads", "clock_ms")], per_rank=True,
                     smoke=args.smoke, preload=("transformers.models.gpt2.modeling_gpt2",))
    return {**ranks[0], "clock_s_per_sample": [r["clock_s_per_sample"] for r in ranks]}


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    add_sizes(p, rounds=3, steps=8, warmup=2, global_batch=16, seq_len=64, d_model=128, layers=4, heads=8)
    p.add_argument("--fast-pair", action="store_true", help="also run the even split on two A100s (the ceiling)")
    p.add_argument("--clock", default="auto",
                   help="auto (default): controlled clock, T calibrated here; a number: T in ms; wall: the wall clock")
    add_smoke(p)
    add_worker_args(p, "split", "spec", "out", "clock-ms")
    args = p.parse_args(argv)
    if not args.worker:
        apply_smoke(p, args, rounds=1, steps=2, warmup=1, global_batch=4, seq_len=16, d_model=32, layers=1, heads=2)
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first timed step starts at the last warm-up step's end)")
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    if not args.worker and args.clock != "auto":     # auto: calibrated on this GPT-2 in main
        resolve_clock(args, p, micro_batch=args.global_batch)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        Path(f"{args.out}.{os.environ.get('RANK', '0')}").write_text(json.dumps(worker(args)))
        return
    if args.clock == "auto":
        args.clock_ms, cpu_ms = calibrate_clock_ms(args)
        print(f"clock: {args.clock_ms:g} ms a sample at speed 1 (8x the {cpu_ms:.2f} ms of CPU a sample the "
              "whole model's forward and backward took here)", flush=True)
    load_before = os.getloadavg()
    names = [n for n in CONFIGS if args.fast_pair or n != "tp-even-fast-pair"]
    steady: dict[str, list[float]] = {n: [] for n in names}
    seen: dict[str, dict] = {}
    started = time.perf_counter()
    for r, name, got in launched(names, args.rounds, lambda _, name: launch(name, args), smoke=args.smoke,
                                 own_cache=True):
        steady[name].append(args.global_batch / statistics.median(got["step_s"]))
        seen[name] = {"speeds": got["speeds"], "micro_batch": got["micro_batch"],
                      "clock_s_per_sample": got["clock_s_per_sample"]}
        print(f"round {r + 1}/{args.rounds}  {name:<18} {steady[name][-1]:7.1f} samples/s at the median step "
              f"({got['samples_per_s']:.1f} over the window)", flush=True)
    per_round = {"speed_vs_even": [s / e for s, e in zip(steady["tp-speed"], steady["tp-even"])]}
    if args.fast_pair:   # the mixed pair split by speed against two fast devices
        per_round["speed_vs_fast_pair"] = [s / f for s, f in zip(steady["tp-speed"], steady["tp-even-fast-pair"])]
    figures = {k: statistics.median(v) for k, v in per_round.items()}
    if args.clock_ms:    # the slowest rank's clock a sample, even over by speed: the clock's own ratio
        figures["clock_only"] = max(seen["tp-even"]["clock_s_per_sample"]) / max(seen["tp-speed"]["clock_s_per_sample"])
    load = {"before": load_before, "after": os.getloadavg(), "cpu_count": os.cpu_count()}
    for name in names:
        print(f"{name:<18} {statistics.median(steady[name]):7.1f} samples/s (median of {args.rounds}; "
              f"plan speeds {seen[name]['speeds']}, micro-batches {seen[name]['micro_batch']})")
    for k, v in figures.items():
        print(f"{k:<16} {v:.3f}   " + (f"(median of the rounds' {', '.join(f'{x:.3f}' for x in per_round[k])})"
                                      if k in per_round else "(the clock alone: slowest rank's T x share / speed)"))
    print(f"host load (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load['before'])} before, "
          f"{'/'.join(f'{x:.2f}' for x in load['after'])} after, on {load['cpu_count']} cores; "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **figures, "per_round": per_round, "samples_per_s": {n: statistics.median(v) for n, v in steady.items()},
            "step_samples_per_s": steady, "plans": seen, "load": load,
            "setup": {"model": f"HF GPT-2 {args.layers} layers d={args.d_model} {args.heads} heads seq {args.seq_len}, "
                               "AdamW, fp32", "cluster": f"{FAST},{SLOW}", "global_batch": args.global_batch,
                      "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                      "clock": f"controlled: {args.clock_ms:g} ms a sample at speed 1" if args.clock_ms else "wall"}},
            indent=2))


if __name__ == "__main__":
    main()
