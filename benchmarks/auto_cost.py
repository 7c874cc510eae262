"""What parallel='auto' costs at prepare(): the demo's GPT on an emulated A100 + RTX 3090 pair.

prepare(parallel="auto") measures what `hetrain plan --model-factory` measures (the ranks'
profiles, the pipeline blocks, FSDP2's excess over a DDP step: runtime/layouts/ranking.py) and
ranks every layout with the same function, so the two agree; prepare(parallel="dp") measures the
profiles alone. Both run here from a fresh profile cache each time (what a first run of a new
model pays), interleaved in rounds, every other round reversed, and the figure is the median
over rounds of auto's prepare() seconds over dp's, measured seconds apart. Each run also records
which layout auto chose, so a change in the answer shows beside the cost.

    PYTHONPATH=src python benchmarks/auto_cost.py --json out.json [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import Parser, add_sizes, add_smoke, add_worker_args, apply_smoke, flags, launched, torchrun

SPEC = "a100-80g:1.0,rtx3090:0.67"
MODES = ("auto", "dp")


def worker(args) -> dict:
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Reporting
    from hetrain.emulation import Emulation
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ht = hetrain.init(global_batch=32, precision="fp32", max_steps=1,
                      emulation=Emulation(cluster=SPEC), reporting=Reporting(verbose=False))
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=4, n_heads=4, vocab_size=256))
    data = ByteWindows(pydoc_bytes(), args.seq_len)
    started = time.perf_counter()
    ht.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data, parallel=args.mode,
               loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    got = {"prepare_s": time.perf_counter() - started, "layout": ht.plan.describe_layout()}
    ht.close()
    return got


def launch(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as cache:          # a fresh profile cache each run
        ranks = torchrun(__file__, 2, ["--worker", "--mode", mode, *flags(args, "d_model", "seq_len")], per_rank=True,
                         env={"HETRAIN_CACHE": cache}, smoke=args.smoke)
    return {"prepare_s": max(r["prepare_s"] for r in ranks), "layout": ranks[0]["layout"]}


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    add_sizes(p, rounds=3, d_model=(64, "the demo GPT's width (4 blocks, 4 heads)"), seq_len=64)
    add_smoke(p)
    add_worker_args(p, "out")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        Path(f"{args.out}.{os.environ.get('RANK', '0')}").write_text(json.dumps(worker(args)))
        return
    apply_smoke(p, args, rounds=1, d_model=16, seq_len=16)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    chosen: list[str] = []
    for r, mode, got in launched(MODES, args.rounds, lambda _, mode: launch(mode, args), smoke=args.smoke):
        seconds[mode].append(got["prepare_s"])
        if mode == "auto":
            chosen.append(got["layout"])
        print(f"round {r + 1}/{args.rounds}  prepare(parallel={mode!r}) {got['prepare_s']:.2f} s  "
              f"({got['layout']})", flush=True)
    ratios = [a / d for a, d in zip(seconds["auto"], seconds["dp"])]
    figures = {"auto_s": statistics.median(seconds["auto"]), "dp_s": statistics.median(seconds["dp"]),
               "auto_over_dp": statistics.median(ratios)}
    print(f"prepare(): auto {figures['auto_s']:.2f} s, dp {figures['dp_s']:.2f} s; auto / dp {figures['auto_over_dp']:.2f} "
          f"(median of the rounds' {', '.join(f'{x:.2f}' for x in ratios)}); auto chose: {', '.join(sorted(set(chosen)))}")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "seconds": seconds, "ratios": ratios,
                                               "auto_chose": chosen, "cluster": SPEC,
                                               "load_after": os.getloadavg(), "smoke": args.smoke}, indent=2))


if __name__ == "__main__":
    main()
