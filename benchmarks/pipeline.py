"""Pipeline stages sized by device speed vs a uniform split, on an emulated 1 : 0.5 pair.

    python benchmarks/pipeline.py --json out.json [--smoke]

A small GPT (12 blocks) as a 2-stage pipeline (`ht.prepare(parallel="pp")`) on an emulated A100
(1.0) and RTX 3090 (0.5), in ONE launch of alternating jobs: the split hetrain sizes from measured
block costs and the devices' speeds, and a uniform 6/6 split (the same Plan, its blocks halved).
Each job's first step is untimed; the median step gives each split's samples/s, and
`speedup_speed_aware_vs_uniform` (target >= 1.2) is printed beside the planner's prediction.
`--dilate F` (default 3) runs both devices F times slower at the same ratio, so each rank mostly
sleeps and the two rarely compete for a core; emulated figures: the ratio means something.
"""

from __future__ import annotations

import os
import statistics
import sys

from _common import Parser, add_sizes, add_smoke, apply_smoke, train_steps

CLUSTER = "a100-80g:1.0,rtx3090:0.5"


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    add_sizes(p, layers=12, d_model=96, seq_len=64, global_batch=64, micro_batches=16,
              rounds=(6, "alternating rounds of each split"), steps=(1, "timed steps per round"))
    p.add_argument("--cluster", default=CLUSTER, help="emulated pair (default: %(default)s)")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32"],
                   help="each stage computes in its device's precision (auto: what the card runs, where this "
                        "CPU runs it at fp32 speed; see the README's Emulation on any CPU)")
    p.add_argument("--show-plan", action="store_true", help="print the speed-aware job's plan and split")
    p.add_argument("--dilate", type=float, default=3.0,
                   help="run every emulated device this many times slower, keeping their ratio: each rank "
                        "then sleeps most of the time, so on a shared CPU the ranks rarely compete for a core")
    add_smoke(p)
    args = p.parse_args(argv)
    # two rounds at least: the first plans the speed-aware split, the uniform one runs from the second
    apply_smoke(p, args, layers=2, d_model=32, seq_len=16, global_batch=8, micro_batches=2, rounds=2, dilate=1.0,
                precision="fp32")
    return args


def run_split(args, data, plan=None):
    """One hetrain job of the small GPT as a 2-stage pipeline: the split hetrain sizes (plan None),
    or the given Plan's. Returns (the job's Plan, its pipeline's split and profile, the timed
    step seconds, the last loss). One warm-up step (metadata, first allocations) is not timed."""
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain import Reporting
    from hetrain.demo.gpt import GPT, GPTConfig

    ht = hetrain.init(global_batch=args.global_batch, max_steps=1 + args.steps, seed=0, precision=args.precision,
                      reporting=Reporting(verbose=plan is None and args.show_plan))
    ht.emulated.throttle.speed /= args.dilate     # same 1 : 0.5 ratio, longer sleeps
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 32))
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    layout = plan if plan is not None else hetrain.Pipeline(micro_batches=args.micro_batches, schedule=args.schedule)
    model, opt, batches = ht.prepare(model, opt, data, parallel=layout,
                                     loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    marks, loss = train_steps(ht, batches)
    times = [b - a for a, b in zip(marks[1:], marks[2:])]        # from the first step's end
    pipe = ht.job.layout.pipe
    out = (ht.plan, pipe.split, pipe.profile, times, loss, cfg)
    ht.close()
    return out


def worker(args) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from hetrain.demo.gpt import GPT
    from hetrain.runtime.layouts.pipeline.split import StageDevice, evaluate_split
    from hetrain.report import write_json

    if args.dilate < 1:
        raise SystemExit("--dilate must be >= 1")
    # One process group for all the jobs: each hetrain.init() uses it as it is.
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.global_batch * 4, args.seq_len + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    runs = {"uniform": {"times": []}, "speed_aware": {"times": []}}
    aware_plan = None
    for _ in range(args.rounds):     # alternating, so both splits see the same machine load
        for name, run in runs.items():
            if name == "uniform" and aware_plan is None:
                continue             # the first round plans the speed-aware split first
            half = args.layers // 2  # uniform: the same plan with the blocks halved (a plan run is not re-planned)
            plan = None if name == "speed_aware" else dataclasses.replace(aware_plan, stage_blocks=(half, args.layers - half))
            job_plan, split, profile, times, loss, cfg = run_split(args, data, plan)
            run.update(split=split, profile=profile, last_loss=loss)
            run["times"] += times
            if name == "speed_aware" and aware_plan is None:
                aware_plan = job_plan
    from hetrain.hardware.host import host_facts

    out = {"cluster": args.cluster, "emulated": True, "dilate": args.dilate, "schedule": args.schedule,
           "precision": {"requested": args.precision, "planned": [d.precision for d in aware_plan.devices]},
           "host": host_facts().to_dict(), "global_batch": args.global_batch, "smoke": args.smoke, "micro_batches": args.micro_batches,
           "model": {"kind": "demo GPT", "layers": cfg.n_layers, "d_model": cfg.d_model, "seq_len": cfg.seq_len,
                     "params": GPT(cfg).num_params()}}
    for name, run in runs.items():
        times = run["times"]
        out[name] = {"samples_per_s": args.global_batch / statistics.median(times), "step_seconds": times,
                     "blocks_per_stage": list(run["split"].sizes), "bubble_fraction": run["split"].bubble_fraction,
                     "last_loss": run["last_loss"]}
    out["throughput_uniform_samples_per_s"] = out["uniform"]["samples_per_s"]
    out["throughput_speed_aware_samples_per_s"] = out["speed_aware"]["samples_per_s"]
    out["speedup_speed_aware_vs_uniform"] = (out["speed_aware"]["samples_per_s"] / out["uniform"]["samples_per_s"])
    # the planner's prediction for both splits, from the same measured block costs
    aware = runs["speed_aware"]["split"]
    devices = [StageDevice(name=s.device, speed=s.speed) for s in aware.stages]
    uniform = evaluate_split(runs["speed_aware"]["profile"], devices, runs["uniform"]["split"].sizes,
                             micro_batches=aware.micro_batches, micro_batch_size=aware.micro_batch_size,
                             schedule=args.schedule)
    out["predicted_speedup"] = aware.samples_per_s / uniform.samples_per_s
    if dist.get_rank() == 0:
        print(f"uniform {out['uniform']['blocks_per_stage']}: {out['throughput_uniform_samples_per_s']:.1f} samples/s; "
              f"speed-aware {out['speed_aware']['blocks_per_stage']}: "
              f"{out['throughput_speed_aware_samples_per_s']:.1f} samples/s; speedup "
              f"{out['speedup_speed_aware_vs_uniform']:.2f}x (predicted {out['predicted_speedup']:.2f}x; emulated)",
              flush=True)
        if args.json:
            write_json(args.json, out)
    dist.destroy_process_group()


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
