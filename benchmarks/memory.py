"""The largest model an emulated 80 GB + 24 GB pair can train, under six memory strategies.

The pair is scaled 1 GB -> 1 MiB (`a100-80g@80MiB,rtx3090@24MiB`, speeds 1 : 0.67) so each trial
is seconds on a CPU; emulated devices count parameters, gradients, optimizer state and saved
activations and raise torch.OutOfMemoryError past their cap, like a GPU. "Trainable" means the
job ran 3 optimizer steps (AdamW, so its state exists from the second forward on) without any
rank running out of memory: every model size is *run*, in fresh processes, and a binary search
over the GPT's width (4 layers, seq 64, vocab 256, global batch 16) finds the largest that trains.

    strategy        plan (shares / micro-batches)                 checkpointing     state sharding
    ddp             equal 8 / 8, whole shares                     none              none (plain DDP)
    hetrain-ckpt    by speed 10 / 6, the 3090 in micro-batches of 1  on the 3090 only  none
    zero1           as hetrain-ckpt                               on the 3090 only  even (ZeroRedundancyOptimizer)
    fsdp            as hetrain-ckpt                               on the 3090 only  even (FSDP2; a rank that
                                                                                    accumulates keeps the
                                                                                    model whole in a step)
    fsdp-whole      by speed 10 / 6, whole shares                 on the 3090 only  even (FSDP2, full ZeRO-3)
    capacity        as hetrain-ckpt                               on the 3090 only  proportional to free memory

    python benchmarks/memory.py --json out.json [--max-width 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import largest_model
from largest_model import report

SPEC = "a100-80g@80MiB,rtx3090@24MiB"
GLOBAL_BATCH, SEQ, VOCAB, LAYERS, HEADS, STEPS = 16, 64, 256, 4, 4, 3
WIDTH_STEP = 8          # the GPT's width is searched in multiples of this (4 heads of width/4)
STRATEGIES = {   # name: (shares, micro-batches, checkpointing per rank, sharding)
    "ddp": ((8, 8), (8, 8), (False, False), "none"),
    "hetrain-ckpt": ((10, 6), (10, 1), (False, True), "none"),
    "zero1": ((10, 6), (10, 1), (False, True), "zero1"),
    "fsdp": ((10, 6), (10, 1), (False, True), "fsdp"),
    "fsdp-whole": ((10, 6), (10, 6), (False, True), "fsdp"),
    "capacity": ((10, 6), (10, 1), (False, True), "capacity"),
}


def n_params(width: int) -> int:
    from hetrain.demo.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=width, n_layers=LAYERS, n_heads=HEADS)).num_params()


# -- inside each worker process ----------------------------------------------------------------
def worker(strategy: str, width: int, out_dir: str, precision: str = "auto") -> None:
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Emulation, Memory, Rebalancing, Reporting
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.planning.plan import DevicePlan, Plan

    rank = int(os.environ["RANK"])
    shares, micros, ckpt, sharding = STRATEGIES[strategy]
    plan = Plan(global_batch=GLOBAL_BATCH, devices=tuple(
        DevicePlan(rank=r, device=name, speed=speed, share=shares[r], micro_batch=micros[r], checkpointing=ckpt[r])
        for r, (name, speed) in enumerate((("a100-80g", 1.0), ("rtx3090", 0.67)))))
    ht = hetrain.init(global_batch=GLOBAL_BATCH, plan=plan, emulation=Emulation(cluster=SPEC),
                      reporting=Reporting(verbose=False), memory=Memory(oom_recovery=False),
                      rebalancing=Rebalancing(enabled=False), sharding=sharding, max_steps=STEPS,
                      precision=precision, timeout_s=120)    # each strategy runs exactly its plan
    torch.manual_seed(0)
    mdl = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=width, n_layers=LAYERS, n_heads=HEADS))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=g),
                                          torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=g))
    def train() -> dict:
        model, opt, batches = ht.prepare(mdl, torch.optim.AdamW(mdl.parameters(), lr=1e-3), data)
        for step in batches:
            for mb in step:
                with mb:
                    x, y = mb.batch
                    with ht.autocast():
                        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                    ht.backward(loss)
            ht.step()
        memory = ht.summary()["memory"]
        return {"measured": [m["measured"] for m in memory], "planned": [m["planned"] for m in memory],
                "caps": [m["cap"] for m in memory]}

    report(ht, rank, out_dir, train)


# -- the driver --------------------------------------------------------------------------------
def trial(strategy: str, width: int, precision: str = "auto") -> dict:
    """Run the job in fresh processes; {'fits': bool, ...}. Raises on anything but success or OOM."""
    return largest_model.trial(__file__, ["--worker", strategy, "--width", str(width), "--precision", precision],
                               f"{strategy} width {width}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--max-width", type=int, default=1024)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: each card's own in the plan, computed in fp32 where this CPU runs it slowly "
                        "(then activations are counted at fp32 size: an upper bound)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.out, args.precision)
        return

    rows = []
    t0 = time.perf_counter()
    for strategy in args.strategies.split(","):
        width, r, tried = largest_model.largest(lambda w, s=strategy: trial(s, w, args.precision), strategy, WIDTH_STEP,
                                                args.max_width, WIDTH_STEP, n_params, lambda s: print(s, flush=True))
        shares, micros, ckpt, sharding = STRATEGIES[strategy]
        rows.append({"strategy": strategy, "max_params": n_params(width), "d_model": width,
                     "peak_bytes_per_device": r["measured"], "planned_bytes_per_device": r["planned"],
                     "memory_cap_per_device": r["caps"], "shares": list(shares), "micro_batches": list(micros),
                     "checkpointing": list(ckpt), "sharding": sharding, "trials": len(tried)})
    base = rows[0]["max_params"]
    print(f"\n{'strategy':<14}{'max params':>12}{'vs ddp':>8}   peak per device (A100 80 : 3090 24, in MiB ~ GB)")
    for row in rows:
        peaks = " / ".join(f"{b / 2**20:.1f}" for b in row["peak_bytes_per_device"])
        print(f"{row['strategy']:<14}{row['max_params'] / 1e6:>11.2f}M{row['max_params'] / base:>7.2f}x   {peaks}")
    setup = {"cluster": SPEC, "scale": "1 GB of the real cards -> 1 MiB emulated",
             "model": f"GPT {LAYERS} layers, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, width searched in steps of "
                      f"{WIDTH_STEP}", "global_batch": GLOBAL_BATCH, "optimizer": "AdamW",
             "precision": f"{args.precision} (auto: bf16 on both cards, compute capability >= 8.0; computed in "
                          "fp32 where this CPU runs bf16 slowly, see host)",
             "trainable": f"{STEPS} optimizer steps without an emulated OOM on any rank",
             "seconds": round(time.perf_counter() - t0)}
    if args.json:
        from hetrain.hardware.host import host_facts

        Path(args.json).write_text(json.dumps({"rows": rows, "setup": setup, "host": host_facts().to_dict()},
                                              indent=2))


if __name__ == "__main__":
    main()
