"""Pipeline stages sized by device speed vs a uniform split, on an emulated 1 : 0.5 pair.

    python benchmarks/pipeline.py --json out.json

Starts two emulated devices (an A100 at speed 1.0 and an RTX 3090 throttled to 0.5) and trains
the same small GPT (12 blocks) through two 2-stage pipelines in ONE run, alternating rounds so
both see the same machine load: a uniform 6/6 split, and the split hetrain sizes from measured
block costs and the devices' speeds. Writes both throughputs and their ratio,
`speedup_speed_aware_vs_uniform` (target >= 1.2), with the planner's prediction beside it.
Figures are emulated: ratios mean something, absolute samples/s do not.

On a shared CPU, other processes slow every rank's compute. The pipeline's throttle scales each
compute piece's wall time (parallel/pipeline.py), so that slows both devices alike and keeps their
ratio; `--dilate F` (default 3) also runs both devices F times slower, same 1 : 0.5 ratio, so
each rank mostly sleeps and the two ranks rarely compete for a core. Step times are interleaved
(one step of each split in turn) and the median is reported; on a quiet machine F does not
change the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

CLUSTER = "a100-80g:1.0,rtx3090:0.5"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--cluster", default=CLUSTER, help="emulated pair (default: %(default)s)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds of each split")
    p.add_argument("--steps", type=int, default=1, help="timed steps per round")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32"],
                   help="pipeline layouts compute fp32 today (per-stage precision comes with the layouts' "
                        "joining); auto records what the cards would run")
    p.add_argument("--dilate", type=float, default=3.0,
                   help="run every emulated device this many times slower, keeping their ratio: each rank "
                        "then sleeps most of the time, so on a shared CPU the ranks rarely compete for a core")
    return p.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.parallel import pipeline
    from hetrain.report import write_json

    ht = hetrain.init(global_batch=args.global_batch, seed=0)
    if args.dilate < 1:
        raise SystemExit("--dilate must be >= 1")
    ht.emulated.throttle.speed /= args.dilate     # same 1 : 0.5 ratio, longer sleeps
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 32))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.global_batch * 4, args.seq_len + 1), generator=g)

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    runs = {}
    for name, split in (("uniform", "uniform"), ("speed_aware", None)):
        torch.manual_seed(0)
        model = GPT(cfg)
        pp = pipeline.prepare(ht, model, loss_fn=loss_fn, micro_batches=args.micro_batches,
                              schedule=args.schedule, split=split,
                              example=data[:args.global_batch // args.micro_batches, :-1])
        runs[name] = {"pp": pp, "opt": torch.optim.AdamW(pp.parameters(), lr=1e-3), "times": [], "losses": []}

    def one_step(run, k):
        batch = data[(k % 4) * args.global_batch:((k % 4) + 1) * args.global_batch]
        t0 = time.perf_counter()
        loss = run["pp"].step(batch[:, :-1], batch[:, 1:])
        run["opt"].step()
        run["opt"].zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss

    for run in runs.values():          # warm-up: metadata inference, first allocations
        one_step(run, 0)
    k = 0
    for _ in range(args.rounds):
        for run in runs.values():
            for _ in range(args.steps):
                k += 1
                seconds, loss = one_step(run, k)
                run["times"].append(seconds)
                run["losses"].append(loss)

    from hetrain.hardware.host import host_facts

    out = {"cluster": args.cluster, "emulated": True, "dilate": args.dilate, "schedule": args.schedule,
           "precision": {"requested": args.precision, "computed": "fp32"}, "host": host_facts().to_dict(),
           "global_batch": args.global_batch, "micro_batches": args.micro_batches,
           "model": {"kind": "demo GPT", "layers": cfg.n_layers, "d_model": cfg.d_model, "seq_len": cfg.seq_len,
                     "params": GPT(cfg).num_params()}}
    for name, run in runs.items():
        pp, times = run["pp"], run["times"]
        out[name] = {"samples_per_s": args.global_batch / statistics.median(times),
                     "step_seconds": times, "blocks_per_stage": list(pp.split.sizes),
                     "bubble_fraction": pp.bubble_fraction, "last_loss": run["losses"][-1]}
    out["throughput_uniform_samples_per_s"] = out["uniform"]["samples_per_s"]
    out["throughput_speed_aware_samples_per_s"] = out["speed_aware"]["samples_per_s"]
    out["speedup_speed_aware_vs_uniform"] = (out["speed_aware"]["samples_per_s"] / out["uniform"]["samples_per_s"])
    # the planner's prediction for both splits, from the same measured block costs
    from hetrain.planning.pipeline_split import evaluate_split

    aware = runs["speed_aware"]["pp"]
    uniform = evaluate_split(aware.profile, pipeline.device_table(ht), runs["uniform"]["pp"].split.sizes,
                             micro_batches=args.micro_batches, micro_batch_size=aware.micro_batch_size,
                             schedule=args.schedule)
    out["predicted_speedup"] = aware.split.samples_per_s / uniform.samples_per_s
    for run in runs.values():
        run["pp"].close()
    ht.print(f"uniform {out['uniform']['blocks_per_stage']}: {out['throughput_uniform_samples_per_s']:.1f} samples/s; "
             f"speed-aware {out['speed_aware']['blocks_per_stage']}: "
             f"{out['throughput_speed_aware_samples_per_s']:.1f} samples/s; speedup "
             f"{out['speedup_speed_aware_vs_uniform']:.2f}x (predicted {out['predicted_speedup']:.2f}x; emulated)")
    if ht.is_main and args.json:
        write_json(args.json, out)
    ht.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:          # a worker started by the launcher
        worker(args)
        return 0
    from hetrain.launch import build_launch, run_launch

    launch = build_launch(target=os.path.abspath(__file__), target_args=tuple(sys.argv[1:] if argv is None else argv),
                          emulate=args.cluster)
    return run_launch(launch)


if __name__ == "__main__":
    sys.exit(main())
