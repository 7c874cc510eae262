"""Heterogeneous data parallelism against what users have today, on an emulated 1 : 0.67 pair.

The demo GPT at one global batch, configs interleaved in rounds (every other round reversed):
  alone-fast / alone-slow   one process, the whole global batch on that one emulated device
  ddp-equal  (mixed pair)   plain torch DDP, DistributedSampler, equal split: today's baseline
  hetrain    (mixed pair)   hetrain's speed-proportional split
  ddp-equal  (fast pair)    plain DDP on two identical fast devices
  hetrain    (fast pair)    hetrain on the same identical pair (its overhead where no split helps)

A run's throughput is the global batch over its median step (the whole-window figure and the share
of steps over 1.25x the median are kept beside it); each figure (`ratios` in main) is the median
over rounds of a ratio within a round. --precision auto: each card's own,
computed in fp32 where this CPU runs it slowly, on both sides. Clock: controlled by default
(benchmarks/_common.py), m·T/speed a micro-batch, for both sides alike.

    python benchmarks/hetero_dp.py --json out.json [--rounds 3 (7 on the wall clock)] [--steps 40] [--clock wall] [--smoke]
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from _common import (FAST, Parser, add_clock_arguments, add_sizes, add_smoke, add_worker_args, apply_smoke, card_autocast,
                     card_policy, clock_s, describe_clock, flags, launched, loss_of, model_and_data, resolve_clock, torchrun)

SLOW = "rtx3090:0.67"
CONFIGS = {   # name: (mode, cluster spec)
    "alone-fast": ("plain", FAST),
    "alone-slow": ("plain", SLOW),
    "ddp-equal-mixed": ("plain", f"{FAST},{SLOW}"),
    "hetrain-mixed": ("hetrain", f"{FAST},{SLOW}"),
    "ddp-equal-fast-pair": ("plain", f"{FAST},{FAST}"),
    "hetrain-fast-pair": ("hetrain", f"{FAST},{FAST}"),
}
# --smoke: each worker on one device and on the mixed pair; the other configs run the same code on
# other cards, and each launch is a torchrun whose ranks import torch (seconds of CPU on CI's 2 cores).
SMOKE = ("alone-fast", "ddp-equal-mixed", "hetrain-mixed")


# -- inside each worker process ----------------------------------------------------------------
def _model_and_data(args):
    return model_and_data(seq_len=args.seq_len, d_model=args.d_model, layers=args.layers)


def worker_plain(args, hook=None) -> tuple[float, list[float]]:
    """Plain DDP + DistributedSampler, equal split, throttled like hetrain's emulation: (samples/s,
    each timed step's seconds). `hook(ddp, world)`: called once on the DDP model (multi_node.py's link)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from hetrain.hardware.cluster import parse_cluster
    from hetrain.emulation.device import Throttle

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    throttle = Throttle(parse_cluster(args.spec)[rank].speed, sample_s=clock_s(args))
    dist.init_process_group("gloo")
    model, data = _model_and_data(args)
    ddp = DDP(model) if world > 1 else model
    if hook is not None:
        hook(ddp, world)
    autocast = card_autocast(args.precision, args.spec, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = iter(DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True))
    t0, ends = None, []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
            ends.append(t0)                    # the first timed step starts here
        x, y = next(loader)
        t = time.thread_time()                 # the same emulation as hetrain's engine:
        with autocast():
            loss = loss_of(ddp, x, y)
        forward_cpu = time.thread_time() - t   # sleep before the backward (emulation/device.py)
        guess = throttle.before_backward(forward_cpu, samples=len(x))
        t = time.thread_time()
        loss.backward()
        throttle.after_backward(forward_cpu, guess, time.thread_time() - t)
        with throttle.compute():
            opt.step()
        opt.zero_grad(set_to_none=True)
        if t0 is not None:
            ends.append(time.perf_counter())
    dist.barrier()
    seconds = time.perf_counter() - t0
    del ddp
    dist.destroy_process_group()
    return args.steps * args.global_batch / seconds, [b - a for a, b in zip(ends, ends[1:])]


def worker_hetrain(args) -> tuple[float, list[float]]:
    ends: list[float] = []
    from hetrain import Reporting
    from hetrain.emulation import Emulation

    sps = timed_hetrain(args, emulation=Emulation(cluster=args.spec, sample_s=clock_s(args) or None),
                        reporting=Reporting(verbose=False), marks=ends)[0]
    return sps, [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])]   # from the last warm-up's end


def timed_hetrain(args, marks: list | None = None, parallel="auto", **init) -> tuple[float, object]:
    """hetrain on the demo GPT: (samples/s over the timed steps, the plan it ran). `init`: more
    hetrain.init() settings (benchmarks/multi_node.py adds its link and compression); `marks`:
    gets the clock at every step's end (the first `warmup` ones included)."""
    import torch

    import hetrain
    from hetrain.benching.worker import timed_steps     # `hetrain bench`'s timed loop

    ht = hetrain.init(global_batch=args.global_batch, precision=args.precision,
                      max_steps=args.warmup + args.steps, **init)
    model, data = _model_and_data(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, batches = ht.prepare(model, opt, data, parallel=parallel)
    marks = [] if marks is None else marks
    seconds = timed_steps(ht, model, batches, warmup=args.warmup, loss=lambda m, batch: loss_of(m, *batch),
                          on_step=lambda step: marks.append(time.perf_counter()))
    plan = ht.plan
    ht.close()
    return args.steps * args.global_batch / seconds, plan


# -- the driver --------------------------------------------------------------------------------
def launch(name: str, args) -> dict:
    mode, spec = CONFIGS[name]
    return torchrun(__file__, len(spec.split(",")), ["--worker", mode, "--spec", spec, *flags(
        args, "steps", "warmup", "global_batch", "seq_len", "d_model", "layers", "precision", "clock_ms")], smoke=args.smoke)


def main() -> None:
    p = Parser(description=__doc__.splitlines()[0])
    add_sizes(p, rounds=(None, "interleaved repetitions, every other one in reverse order; medians are reported "
                               "(default: 3 on the controlled clock, 7 on the wall clock)"),
              steps=40, warmup=5, global_batch=64, seq_len=64, d_model=128, layers=4)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: each card's own, computed in fp32 where this CPU runs it slowly")
    add_clock_arguments(p)
    add_smoke(p)
    add_worker_args(p, "spec", "out", choices=["plain", "hetrain"])
    args = p.parse_args()
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first timed step's start is the last warm-up step's end)")

    if args.worker:
        sps, steps = (worker_plain if args.worker == "plain" else worker_hetrain)(args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.out).write_text(json.dumps({"samples_per_s": sps, "step_s": steps}))
        return
    apply_smoke(p, args, rounds=1, steps=2, warmup=1, global_batch=8, seq_len=16, d_model=32, layers=1,
                precision="fp32")
    if args.rounds is None:
        args.rounds = 7 if args.clock == "wall" else 3
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1")
    resolve_clock(args, p, micro_batch=max(1, args.global_batch // 2))    # the pair's micro-batch

    names = list(SMOKE if args.smoke else CONFIGS)
    runs: dict[str, list[float]] = {name: [] for name in names}       # whole timed window
    steady: dict[str, list[float]] = {name: [] for name in names}     # at the run's median step
    slow_steps: dict[str, list[float]] = {name: [] for name in names}
    for r, name, got in launched(names, args.rounds, lambda _, name: launch(name, args), smoke=args.smoke,
                                 own_cache=True):
        runs[name].append(got["samples_per_s"])
        typical = statistics.median(got["step_s"])
        steady[name].append(args.global_batch / typical)
        slow_steps[name].append(sum(t > 1.25 * typical for t in got["step_s"]) / len(got["step_s"]))
        print(f"round {r + 1}/{args.rounds}  {name:<22} {runs[name][-1]:7.1f} samples/s "
              f"({steady[name][-1]:.1f} at the median step)", flush=True)
    whole = {name: statistics.median(v) for name, v in runs.items()}
    med = {name: statistics.median(v) for name, v in steady.items()}

    # Each figure is a ratio of runs made minutes apart on a shared host whose speed drifts (10%
    # between two runs of this benchmark here): taken within each round, from runs made seconds
    # apart, then the median over rounds, drift cancels; a ratio of medians would keep it.
    speeds = [1.0, 0.67]
    ratios = {
        "efficiency": lambda r: r["hetrain-mixed"] / (r["alone-fast"] + r["alone-slow"]),
        "balance_efficiency": lambda r: r["hetrain-mixed"] / (r["ddp-equal-fast-pair"] * sum(speeds)
                                                               / (2 * max(speeds))),
        "speedup_vs_equal": lambda r: r["hetrain-mixed"] / r["ddp-equal-mixed"],
        "identical_pair_ratio": lambda r: r["hetrain-fast-pair"] / r["ddp-equal-fast-pair"],
    }
    def ran(f) -> bool:      # --smoke: only the figures whose configs ran
        try:
            f(dict.fromkeys(names, 1.0))
        except KeyError:
            return False
        return True
    ratios = {k: f for k, f in ratios.items() if ran(f)}

    def within_rounds(values: dict[str, list[float]]) -> tuple[dict, dict]:
        per = {k: [f({name: v[i] for name, v in values.items()}) for i in range(args.rounds)] for k, f in ratios.items()}
        return per, {k: statistics.median(v) for k, v in per.items()}

    per_round, figures = within_rounds(steady)
    per_round_whole, figures_whole = within_rounds(runs)
    from hetrain.hardware.host import host_facts

    host, policy = host_facts(), card_policy(args.precision, FAST)
    setup = {"model": f"GPT {args.layers} layers d={args.d_model} seq {args.seq_len}, AdamW",
             "precision": {"requested": args.precision, "card": policy.name, "computed": policy.compute,
                           "why": policy.choice.reason if policy.choice else ""},
             "global_batch": args.global_batch, "steps": args.steps, "warmup": args.warmup,
             "rounds": args.rounds, "cpu_threads_per_device": 1, "host_cores": os.cpu_count(),
             "clock": describe_clock(args)}

    alone = med["alone-fast"]
    print(f"\n{'config':<36}{'samples/s':>10}{'speedup':>9}{'window':>9}{'slow steps':>12}"
          f"   (median of {args.rounds}: at each run's median step, vs alone-fast; "
          f"window: over the whole timed window; slow: steps over 1.25x the run's median)")
    rows = [("A100-80G alone (emulated)", "alone-fast"), ("RTX 3090 alone (emulated, 0.67)", "alone-slow"),
            ("DDP equal split, A100 + 3090", "ddp-equal-mixed"), ("hetrain, A100 + 3090", "hetrain-mixed"),
            ("DDP, 2x A100", "ddp-equal-fast-pair"), ("hetrain, 2x A100", "hetrain-fast-pair")]
    for label, name in (row for row in rows if row[1] in names):
        print(f"{label:<36}{med[name]:>10.1f}{med[name] / alone:>8.2f}x{whole[name]:>9.1f}"
              f"{statistics.median(slow_steps[name]):>11.0%}")
    print()
    for k, v in figures.items():
        print(f"{k:<22} {v:.3f}   (median of the rounds' {', '.join(f'{x:.3f}' for x in per_round[k])}; "
              f"whole window {figures_whole[k]:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **figures, "per_round": per_round, "samples_per_s": med, "step_samples_per_s": steady,
            "whole_window": {**figures_whole, "per_round": per_round_whole, "samples_per_s": whole, "runs": runs},
            "slow_step_fraction": slow_steps, "setup": setup, "host": host.to_dict(), "smoke": args.smoke}, indent=2))
    print(f"host: {host.describe()}; precision {args.precision}: the cards run {policy.name}, "
          f"computed in {policy.compute}")


if __name__ == "__main__":
    main()
