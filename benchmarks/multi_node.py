"""Two nodes on loopback with a slow emulated link between them: hetrain against equal-split DDP,
with and without gradient compression, measured side by side in one run.

Each config is one job of two "nodes", each a launcher on this host joined by torchrun's c10d
rendezvous: node 0 holds an emulated A100-80G, node 1 an emulated RTX 3090 (speed 0.67). Every
gradient all-reduce crosses the emulated inter-node link, throttled to --link-gbs GB/s for the
bytes actually sent (emulation/link.py), in both hetrain and the plain baseline:
  ddp-equal        plain torch DDP (torchrun c10d), DistributedSampler, equal split
  ddp-equal-fp16   the same with torch's fp16_compress_hook
  hetrain          `hetrain run --nnodes 2`, speed-proportional shares, compression='none'
  hetrain-fp16     the same with compression='fp16'
  hetrain-auto     compression='auto': what the planner picks for this link (printed)
Configs run interleaved in rounds (every other round reversed), and each figure is the median over
rounds of a ratio within a round, so the host's drift cancels.

    python benchmarks/multi_node.py --json out.json [--link-gbs 0.05] [--rounds 2] [--steps 20] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import Parser, add_sizes, add_smoke, add_worker_args, apply_smoke, flags, launched  # noqa: E402
from hetero_dp import timed_hetrain, worker_plain as plain_ddp  # noqa: E402 — the same model, data, loop
from harness import free_port  # noqa: E402 — the tests' loopback port, as checkpoint_io.py uses

NODES = ("a100-80g:1.0", "rtx3090:0.67")
CONFIGS = {"ddp-equal": ("plain", "none"), "ddp-equal-fp16": ("plain", "fp16"),
           "hetrain": ("hetrain", "none"), "hetrain-fp16": ("hetrain", "fp16"), "hetrain-auto": ("hetrain", "auto")}
# --smoke: each worker once (plain DDP through torch's fp16 hook, hetrain choosing for the link); the
# other configs are the same two code paths with other flags, and a launch of two nodes is ~20 s of CPU.
SMOKE = ("ddp-equal-fp16", "hetrain-auto")


# -- inside each worker process ----------------------------------------------------------------
def worker_plain(args) -> tuple[float, str]:
    """hetero_dp.worker_plain, its all-reduce through the same emulated link (and torch's fp16 hook
    when asked): (samples/s, the compression it ran)."""
    from hetrain.emulation.link import LinkThrottle
    from hetrain.runtime.resilience.oom import install
    from hetrain.runtime.sharding.comm_hooks import GradientHook

    def link(ddp, world):
        install(ddp, GradientHook(args.compression, link=LinkThrottle(gbs=args.link_gbs, ring=world)), guard=False)

    return plain_ddp(args, hook=link)[0], args.compression


def worker_hetrain(args) -> tuple[float, str]:
    """hetrain's loop, timed (hetero_dp.timed_hetrain), on this node's devices (its launch file's
    --emulate), through the emulated link: (samples/s, the compression the plan ran)."""
    from hetrain import Compression, DataParallel, Reporting
    from hetrain.emulation import Emulation

    sps, plan = timed_hetrain(args, compression=Compression(method=args.compression),
                              emulation=Emulation(link_gbs=args.link_gbs),    # the devices: the launch file's
                              reporting=Reporting(verbose=args.verbose),
                              parallel=DataParallel(sharding="none"))
    return sps, plan.compression


# -- the driver --------------------------------------------------------------------------------
def launch(name: str, args) -> dict:
    """One job of two launchers (one per node) on one rendezvous; rank 0's figures."""
    mode, compression = CONFIGS[name]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        work = ["--worker", mode, "--compression", compression, "--spec", ",".join(NODES), "--out", str(out), *flags(
            args, "steps", "warmup", "global_batch", "seq_len", "d_model", "layers", "precision", "link_gbs")]
        procs = []
        for node, device in enumerate(NODES):
            if mode == "hetrain":
                cmd = [sys.executable, "-m", "hetrain", "run", "--nnodes", "2", "--node-rank", str(node),
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-name", f"node{node}", "--emulate", device,
                       __file__, *work] + (["--verbose"] if args.verbose and node == 0 else [])
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
                       "--rdzv-conf", f"is_host={int(node == 0)}", __file__, *work]
            quiet = None if args.verbose and node == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                          stdout=quiet, stderr=quiet))
            if node == 0:
                time.sleep(1.0)          # node 0 hosts the rendezvous: let it bind first
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise SystemExit(f"{name}: launchers exited {codes} (rerun with --verbose)")
        return json.loads(out.read_text())


def main() -> None:
    p = Parser(description=__doc__.splitlines()[0])
    add_sizes(p, rounds=2, steps=20, warmup=4, global_batch=32, seq_len=64, d_model=128, layers=4)
    p.add_argument("--link-gbs", type=float, default=0.05, help="the emulated inter-node link, GB/s")
    p.add_argument("--precision", default="fp32", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--verbose", action="store_true", help="show node 0's output")
    add_smoke(p)
    add_worker_args(p, "spec", "out", choices=["plain", "hetrain"])
    p.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        sps, chosen = (worker_plain if args.worker == "plain" else worker_hetrain)(args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.out).write_text(json.dumps({"samples_per_s": sps, "compression": chosen}))
        return

    apply_smoke(p, args, rounds=1, steps=2, warmup=1, global_batch=8, seq_len=16, d_model=32, layers=1)
    names = list(SMOKE if args.smoke else CONFIGS)
    rounds: list[dict] = [{} for _ in range(args.rounds)]
    chosen = set()
    for r, name, result in launched(names, args.rounds, lambda _, name: launch(name, args), smoke=args.smoke):
        rounds[r][name] = result["samples_per_s"]
        if name == "hetrain-auto":
            chosen.add(result["compression"])
        print(f"round {r + 1}/{args.rounds}  {name:15s} {rounds[r][name]:8.1f} samples/s", file=sys.stderr)
    median = {n: statistics.median(rd[n] for rd in rounds) for n in names}
    ratio = lambda a, b: statistics.median(rd[a] / rd[b] for rd in rounds)   # noqa: E731 — within a round
    ratios = {f"{a}_vs_{b}".replace("-", "_"): ratio(a, b) for a, b in (
        ("hetrain", "ddp-equal"), ("hetrain-fp16", "ddp-equal"), ("hetrain-fp16", "hetrain"),
        ("ddp-equal-fp16", "ddp-equal"), ("hetrain-auto", "hetrain"),
        ("hetrain-auto", "ddp-equal-fp16")) if a in names and b in names}
    print(f"\n2 nodes on loopback ({' | '.join(NODES)}), emulated inter-node link {args.link_gbs:g} GB/s, "
          f"global batch {args.global_batch}, {args.steps} timed steps, {args.rounds} round(s)")
    for n in names:
        print(f"  {n:15s} {median[n]:8.1f} samples/s (median)")
    for k, v in ratios.items():
        print(f"  {k:28s} {v:.2f}x")
    print(f"  hetrain-auto chose compression: {', '.join(sorted(chosen))}")
    if args.json:
        Path(args.json).write_text(json.dumps({"link_gbs": args.link_gbs, "nodes": NODES, "rounds": rounds,
                                               "median_samples_per_s": median, "ratios": ratios,
                                               "auto_chose": sorted(chosen), "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
