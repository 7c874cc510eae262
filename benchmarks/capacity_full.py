"""Capacity-proportional full sharding against even FSDP2 on an emulated 80 GB + 24 GB pair.

The pair is scaled 1 GB -> 1 MiB (`a100-80g@80MiB,rtx3090@24MiB`, speeds 1 : 0.67); emulated
devices count parameters, gradients, optimizer state, gathered units and saved activations and
raise torch.OutOfMemoryError past their cap. Both strategies run the same plan: shares by speed
5 / 3, each rank's share in one micro-batch (full ZeRO-3: nothing kept gathered through a step),
activation checkpointing on both cards, AdamW, fp32, a GPT of 16 layers (seq 32, vocab 256).

(a) The largest trainable model: a binary search over the GPT's width, every candidate *run* (2
    optimizer steps in fresh processes, no rank out of memory), not predicted. Reported: the
    parameters of the largest width each trains, and their ratio (bound: (80 + 24) / (2 · 24) ≈ 2.17).
(b) Throughput at a width both train: rounds interleaved (fsdp, capacity-full, fsdp, ...), each
    a fresh job of `--steps` steps, samples/s of its timed steps; the ratio of the medians.

    python benchmarks/capacity_full.py --json out.json [--rounds 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import largest_model
from largest_model import report

SPEC = "a100-80g@80MiB,rtx3090@24MiB"
GLOBAL_BATCH, SEQ, VOCAB, LAYERS, HEADS = 8, 32, 256, 16, 4
SHARES, MICROS, CKPT = (5, 3), (5, 3), (True, True)
WIDTH_STEP = 4           # 4 heads of width/4
MARGIN = 0.02            # capacity-full sizes its split to the cap less this (FSDP2 has no such knob)
STRATEGIES = ("fsdp", "capacity-full")


def n_params(width: int) -> int:
    from hetrain.demo.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=width, n_layers=LAYERS, n_heads=HEADS)).num_params()


# -- inside each worker process ----------------------------------------------------------------
def worker(sharding: str, width: int, steps: int, out_dir: str) -> None:
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Emulation, Memory, Rebalancing, Reporting
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.planning.plan import DevicePlan, Plan

    rank = int(os.environ["RANK"])
    plan = Plan(global_batch=GLOBAL_BATCH, devices=tuple(
        DevicePlan(rank=r, device=name, speed=speed, share=SHARES[r], micro_batch=MICROS[r], checkpointing=CKPT[r])
        for r, (name, speed) in enumerate((("a100-80g", 1.0), ("rtx3090", 0.67)))))
    ht = hetrain.init(global_batch=GLOBAL_BATCH, plan=plan, emulation=Emulation(cluster=SPEC),
                      reporting=Reporting(verbose=False), memory=Memory(oom_recovery=False, margin=MARGIN),
                      rebalancing=Rebalancing(enabled=False), sharding=sharding, max_steps=steps,
                      precision="fp32", timeout_s=120)
    torch.manual_seed(0)
    mdl = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=width, n_layers=LAYERS, n_heads=HEADS))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ), generator=g),
                                          torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ), generator=g))
    def train() -> dict:
        model, opt, batches = ht.prepare(mdl, torch.optim.AdamW(mdl.parameters(), lr=1e-3), data)
        for step in batches:
            for mb in step:
                with mb:
                    x, y = mb.batch
                    ht.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
            ht.step()
        summary = ht.summary()
        return {"held": [m["held_state"] for m in summary["memory"]], "caps": [m["cap"] for m in summary["memory"]],
                "samples_per_s": summary["samples_per_s"]}

    report(ht, rank, out_dir, train)


# -- the driver --------------------------------------------------------------------------------
def trial(sharding: str, width: int, steps: int) -> dict:
    return largest_model.trial(__file__, ["--worker", sharding, "--width", str(width), "--steps", str(steps)],
                               f"{sharding} width {width}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--lo", type=int, default=64, help="smallest width searched")
    p.add_argument("--hi", type=int, default=256, help="largest width searched")
    p.add_argument("--rounds", type=int, default=2, help="throughput: interleaved rounds per strategy")
    p.add_argument("--steps", type=int, default=6, help="throughput: optimizer steps per round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.steps, args.out)
        return
    t0 = time.perf_counter()
    say = lambda s: print(s, flush=True)   # noqa: E731
    rows = {}
    for sharding in STRATEGIES:
        width, r, tried = largest_model.largest(lambda w, s=sharding: trial(s, w, 2), sharding, args.lo, args.hi,
                                                WIDTH_STEP, n_params, say)
        rows[sharding] = {"d_model": width, "max_params": n_params(width), "held_bytes_per_device": r["held"],
                          "memory_cap_per_device": r["caps"], "trials": tried}
    ratio = rows["capacity-full"]["max_params"] / rows["fsdp"]["max_params"]
    say(f"largest trainable: fsdp {rows['fsdp']['max_params'] / 1e6:.2f}M (width {rows['fsdp']['d_model']}), "
        f"capacity-full {rows['capacity-full']['max_params'] / 1e6:.2f}M (width {rows['capacity-full']['d_model']}): "
        f"{ratio:.2f}x (bound (80 + 24) / (2 x 24) = 2.17x)")
    both = rows["fsdp"]["d_model"] // WIDTH_STEP * WIDTH_STEP
    speeds = {s: [] for s in STRATEGIES}
    for k in range(args.rounds):
        for sharding in STRATEGIES:
            r = trial(sharding, both, args.steps)
            if not r["fits"]:
                raise RuntimeError(f"{sharding} at width {both} ran out of memory in the throughput rounds")
            speeds[sharding].append(r["samples_per_s"])
            say(f"  round {k + 1}: {sharding:<14} width {both}: {r['samples_per_s']:.2f} samples/s")
    median = {s: statistics.median(v) for s, v in speeds.items()}
    say(f"throughput at width {both} ({n_params(both) / 1e6:.2f}M): fsdp {median['fsdp']:.2f}, capacity-full "
        f"{median['capacity-full']:.2f} samples/s: {median['capacity-full'] / median['fsdp']:.2f}x")
    out = {"largest": rows, "param_ratio": ratio, "bound": (80 + 24) / (2 * 24),
           "throughput": {"d_model": both, "params": n_params(both), "samples_per_s": speeds, "median": median,
                          "ratio": median["capacity-full"] / median["fsdp"]},
           "setup": {"cluster": SPEC, "scale": "1 GB of the real cards -> 1 MiB emulated",
                     "model": f"GPT {LAYERS} layers, {HEADS} heads, seq {SEQ}, vocab {VOCAB}",
                     "plan": {"shares": SHARES, "micro_batches": MICROS, "checkpointing": CKPT},
                     "optimizer": "AdamW", "precision": "fp32", "memory_margin": MARGIN,
                     "seconds": round(time.perf_counter() - t0)}}
    if args.json:
        from hetrain.hardware.host import host_facts

        Path(args.json).write_text(json.dumps({**out, "host": host_facts().to_dict()}, indent=2))


if __name__ == "__main__":
    main()
