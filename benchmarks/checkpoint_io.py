"""Checkpoint hashing and verification: rank 0 alone (the code before issue 14) against every rank
its own share (runtime/resilience/store.py), on ~1 GiB of model + optimizer state, 2 gloo ranks.

A stack of 4096x4096 Linear layers with AdamW's state made (3 x 4 bytes a parameter), saved once
(Checkpointer.save); then each way is timed on that checkpoint between the barriers peers wait in:

    save, before   rank 0 fsyncs and hashes every file; rank 1 waits in the barrier
    save, after    each rank fsyncs and hashes its own files (store.hash_share), then the gather
    load, before   rank 0 checks every file against the manifest (manifest.verify); rank 1 waits
    load, after    Checkpointer.latest(): rank 0 reads the manifest, each rank checks its share

The files come from the page cache, so the figures are hashing (CPU) time; --rounds alternations.

    python benchmarks/checkpoint_io.py [--gib 1.0] [--rounds 2] [--dir DIR] [--json out.json] [--smoke]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _common import Parser, add_smoke, apply_smoke  # noqa: E402

WIDTH = 4096


class Log:
    def warn_job(self, message):
        print(f"warning: {message}", flush=True)


def old_save_hashing(directory: Path) -> dict:
    """What rank 0 did before: fsync and hash every file of the checkpoint, one after another."""
    from hetrain.runtime.resilience.manifest import MANIFEST
    from hetrain.runtime.resilience.store import hash_files

    return hash_files(directory, [f.name for f in sorted(directory.iterdir()) if f.name != MANIFEST], 0)


def timed(fn, cpu: list | None = None) -> float:
    """Wall seconds from a barrier to the next (the window the peers wait in); appends this
    rank's CPU seconds in it to `cpu` (on a host shared with other work, the split shows there)."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    dist.barrier()
    if cpu is not None:
        cpu.append(c1 - c0)
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, port: int, directory: str, gib: float, rounds: int, out: str,
              width: int = WIDTH) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from hetrain.runtime.resilience import manifest as mf
    from hetrain.runtime.resilience.store import Checkpointer, gather_all, hash_share
    from hetrain.runtime.sharding.optim_slices import init_optimizer_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layers = max(1, round(gib * 2 ** 30 / (3 * 4 * (width * width + width))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_optimizer_state(opt)       # the moments exist from here: 3 tensors a parameter
    ck = Checkpointer(directory, keep=2, rank=rank, log=Log())
    meta = {"step": 1, "sampler": {}, "plan": "{}", "rng": [], "model_signature": "bench", "global_batch": 1}
    save_s = timed(lambda: ck.save(1, model=model, optimizer=opt, meta=meta))
    path = ck.path(1)
    total = sum(f.stat().st_size for f in path.iterdir())
    mine = hash_share(path, rank, world)
    ways = {"save_before": lambda: old_save_hashing(path) if rank == 0 else None,
            "save_after": lambda: gather_all(hash_share(path, rank, world)),
            "load_before": lambda: mf.verify(path) if rank == 0 else None,
            "load_after": lambda: ck.latest()}
    times, cpu = {k: [] for k in ways}, {k: [] for k in ways}
    for _ in range(rounds):
        for k, fn in ways.items():
            times[k].append(timed(fn, cpu[k]))
    assert ck.latest() == path and mf.verify(path) is None
    ck.close()
    shares = gather_all(sum(e["bytes"] for e in mine.values()))
    cpu = gather_all(cpu)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": total, "layers": layers, "width": width, "save_s": save_s, "bytes_per_rank": shares,
                       "times": times, "cpu_by_rank": cpu, "rounds": rounds, "cpus": len(os.sched_getaffinity(0))}, f)
    dist.barrier()
    dist.destroy_process_group()
    # leave without the interpreter's teardown: a native thread still joinable there aborted the
    # process (SIGABRT, "terminate called without an active exception") about 1 run in 4
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model + optimizer state to save (GiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temporary dir, removed)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--width", type=int, default=WIDTH, help="the Linear layers' width (default %(default)s)")
    add_smoke(ap)
    args = ap.parse_args()
    apply_smoke(ap, args, gib=0.01, rounds=1, width=256)
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from harness import free_port

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hetrain-ckpt-bench-"))
    result_file = work / "result.json"
    try:
        mp.spawn(rank_main, args=(2, free_port(), str(work / "ck"), args.gib, args.rounds, str(result_file), args.width),
                 nprocs=2, join=True)
        r = json.loads(result_file.read_text())
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    gib = r["bytes"] / 2 ** 30
    print(f"checkpoint: {gib:.2f} GiB ({r['layers']} Linear({r['width']},{r['width']}) + AdamW moments), 2 gloo ranks; "
          f"bytes hashed per rank after: {', '.join(f'{b / 2 ** 30:.2f} GiB' for b in r['bytes_per_rank'])}")
    print(f"one Checkpointer.save (DCP write + split hashing + manifest): {r['save_s']:.2f} s")
    print(f"{r['cpus']} CPUs visible; wall = the window between two barriers (what timeout_s bounds), "
          "CPU = each rank's own hashing seconds in it")
    print(f"{'':26s} {'before: rank 0 all':>30s} {'after: each rank its share':>30s}")
    for what, key in (("save: hash the files", "save"), ("load: verify the newest", "load")):
        b, a = r["times"][f"{key}_before"], r["times"][f"{key}_after"]
        cb, ca = (["/".join(f"{min(c[k]):.2f}" for c in r["cpu_by_rank"]) for k in (f"{key}_before", f"{key}_after")])
        print(f"{what:26s} {min(b):6.2f} s wall (CPU r0/r1 {cb}) {min(a):6.2f} s wall (CPU r0/r1 {ca})")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
