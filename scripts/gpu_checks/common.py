"""What the GPU check's steps share (scripts/gpu_check.sh runs each step as its own process).

A step module calls `main(STEPS)`: `python3 MODULE.py STEP --result FILE --limit S [--dry]` runs one
step and writes its result, {"status": pass|fail|skip, "figure", "reason", "details"}, to FILE.
A step needing CUDA is skipped under --dry before torch is imported, with the reason it needs it.
`python3 common.py verdict ...` merges the results and the shell's timings into summary.json and
prints the verdict table. This module imports nothing but the standard library at its top, so the
verdict is written even where torch cannot be imported.

Also here: the rank launcher (several processes on one machine, each with torchrun's variables),
the models the steps train, and a clock that is CUDA events on a GPU and perf_counter on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REHEARSE = "GPU_CHECK_REHEARSE"
ROOT = HERE.parents[1]


# -- results ------------------------------------------------------------------------------------
class Claims:
    """A step's expectations: each one checked and kept; the step fails when any failed."""

    def __init__(self):
        self.failed: list[str] = []
        self.details: dict = {}

    def expect(self, ok: bool, what: str) -> bool:
        print(("  ok   " if ok else "  FAIL ") + what, flush=True)
        if not ok:
            self.failed.append(what)
        return ok

    def note(self, key: str, value) -> None:
        print(f"  {key}: {value}", flush=True)
        self.details[key] = value

    def outcome(self, figure: str) -> dict:
        if self.failed:
            return {"status": "fail", "figure": figure, "reason": "; ".join(self.failed), "details": self.details}
        return {"status": "pass", "figure": figure, "reason": "", "details": self.details}


def skipped(reason: str, **details) -> dict:
    return {"status": "skip", "figure": "", "reason": reason, "details": details}


def main(steps: dict) -> None:
    """steps: {name: (function(args) -> result dict, why it needs CUDA or None)}."""
    p = argparse.ArgumentParser(description="one step of scripts/gpu_check.sh")
    p.add_argument("step", choices=sorted(steps))
    p.add_argument("--result", required=True, help="where the step's result JSON goes")
    p.add_argument("--limit", type=float, default=60.0, help="the step's time limit (s)")
    p.add_argument("--scratch", default=None, help="a folder for the step's throwaway files")
    p.add_argument("--dry", action="store_true", help="no CUDA: skip what needs it, with the reason")
    args = p.parse_args()
    fn, needs_cuda = steps[args.step]
    args.deadline = time.monotonic() + args.limit
    args.scratch = args.scratch or os.environ.get("GPU_CHECK_SCRATCH") or "/tmp"
    # A rehearsal runs the CUDA steps on the CPU at toy sizes: their code paths, not their figures
    # (for whoever changes a step without a GPU at hand; never part of the check).
    args.rehearse = os.environ.get(REHEARSE) == "1"
    print(f"=== {args.step} (limit {args.limit:.0f} s{', dry' if args.dry else ''})", flush=True)
    if args.dry and needs_cuda and not args.rehearse:
        result = skipped(f"--dry: needs CUDA ({needs_cuda})")
    else:
        try:
            result = fn(args)
        except Exception as e:   # the step's own failure: its verdict row, then the next step
            traceback.print_exc()
            first = (str(e).strip().splitlines() or [""])[0][:300]
            result = {"status": "fail", "figure": "", "reason": f"{type(e).__name__}: {first}", "details": {}}
    print(f"--- {args.step}: {result['status']} {result['figure']} {result['reason']}".rstrip(), flush=True)
    Path(args.result).write_text(json.dumps(result, default=str))


def device_of(args):
    """cuda:0, or the CPU in a rehearsal."""
    import torch

    return torch.device("cpu") if args.rehearse else torch.device("cuda", 0)


def remaining(args, reserve: float = 3.0) -> float:
    """Seconds left of the step's limit, less a reserve for writing its result."""
    return max(1.0, args.deadline - time.monotonic() - reserve)


# -- processes ----------------------------------------------------------------------------------
_GROUPS: list = []     # children started in sessions of their own: killed with this step


def _kill_groups(*_):
    import signal

    for p in _GROUPS:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
    sys.exit(124)


def run_group(cmd: list[str], *, timeout: float, echo: bool = True, **kw) -> tuple[int | None, str]:
    """Run cmd in a session of its own, output captured (and printed); on timeout kill its whole
    process group (a launcher's workers hold the GPU: they must not outlive the step).
    (exit code or None on timeout, output)."""
    import signal

    signal.signal(signal.SIGTERM, _kill_groups)     # the shell's limit reaches the group too
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)
    _GROUPS.append(p)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = None
    if echo or rc != 0:
        print(out, flush=True)
    return rc, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, worker: str, world: int, *, timeout: float, out: str, params: dict | None = None,
              rank_env: dict | None = None) -> list:
    """`worker` of `script` on `world` processes, each with torchrun's variables (LOCAL_RANK 0 on
    all of them unless rank_env says otherwise: they share one GPU). Each returns a JSON value;
    a rank that raised, died or outlived `timeout` is an error naming it."""
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
               "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world),
               "OMP_NUM_THREADS": "1", **(rank_env or {}).get(r, {})}
        cmd = [sys.executable, script, "--worker", worker, "--out", out, "--params", json.dumps(params or {})]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    results, problems = [], []
    for r, p in enumerate(procs):
        path = Path(out) / f"{worker}-rank{r}.json"
        got = json.loads(path.read_text()) if path.exists() else {"error": "no result written"}
        if r in hung:
            problems.append(f"rank {r} still running after {timeout:.0f} s")
        elif "error" in got:
            problems.append(f"rank {r}: {got['error']}")
        elif p.returncode != 0:
            problems.append(f"rank {r} exited {p.returncode} after its result")
        results.append(got.get("value"))
    if problems:
        raise RuntimeError("; ".join(problems))
    return results


def worker_main(workers: dict) -> bool:
    """In a rank launched by run_ranks: run the named worker, write its result; True if this
    process was a worker (the module's main must not run then)."""
    if "--worker" not in sys.argv:
        return False
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--params", default="{}")
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    path = Path(a.out) / f"{a.worker}-rank{rank}.json"
    try:
        value = workers[a.worker](rank, int(os.environ["WORLD_SIZE"]), **json.loads(a.params))
        path.write_text(json.dumps({"value": value}, default=str))
    except BaseException as e:
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        path.write_text(json.dumps({"error": f"{type(e).__name__}: {first}"}))
        sys.stdout.flush()
        os._exit(1)       # peers may be blocked in a collective: no teardown
    return True


def join_gloo(device_type: str):
    """This rank's gloo group over MASTER_ADDR/PORT (made before hetrain.init, which then uses it)."""
    import datetime

    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=120))
    return dist


def leave_group() -> None:
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# -- the models ---------------------------------------------------------------------------------
def tower(d: int, layers: int, vocab: int, *, hook=None):
    """A token model of `layers` MLP blocks (Linear d->4d, GELU, Linear 4d->d, residual): large
    matrix products and few kernels, so device time dominates launch time. `hook(x)` runs in the
    middle of the blocks (the OOM step's backward allocation). Its blocks are class `Block`."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.embed(ids)
            for i, block in enumerate(self.blocks):
                if hook is not None and i == layers // 2:
                    x = hook(x)
                x = block(x)
            return self.head(x)

    return Tower()


def token_data(n: int, seq: int, vocab: int, seed: int = 0):
    """n samples of `seq` token ids and their next-token targets (a dataset of (x, y))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return torch.utils.data.TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def token_loss(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def micro_batches(ht, model, step) -> None:
    """The user's loop over one step's micro-batches: forward under the job's autocast, weighted backward."""
    for mb in step:
        with mb:
            x, y = mb.batch
            with ht.autocast():
                loss = token_loss(model(x), y)
            ht.backward(loss)


def plan(devices: list[tuple[str, int, int]], global_batch: int):
    """A fixed Plan: [(device label, share, micro-batch)] by rank (no measuring before training)."""
    import hetrain

    return hetrain.Plan(global_batch=global_batch, devices=tuple(
        hetrain.DevicePlan(rank=r, device=name, speed=1.0, share=share, micro_batch=micro)
        for r, (name, share, micro) in enumerate(devices)))


# -- time ---------------------------------------------------------------------------------------
class Clock:
    """Marks on the device's stream: CUDA events (read once, after a synchronize) on a GPU, the
    wall clock on a CPU. `seconds(a, b)` after `settle()`."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def settle(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def ratio(got: float, truth: float) -> float:
    return got / truth if truth > 0 else math.inf


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else math.nan


def nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def gib(n) -> str:
    return f"{(n or 0) / 2**30:.2f} GiB"


def read_metrics(directory: str) -> list[dict]:
    """metrics.jsonl's lines (hetrain's public record of a run)."""
    path = Path(directory) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -- the verdict ----------------------------------------------------------------------------------
def verdict(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--scratch", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--started", type=float, required=True)
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    rows = []
    for line in (Path(a.scratch) / "steps.tsv").read_text().splitlines():
        name, log, limit, seconds, rc = line.split("\t")
        path = Path(a.scratch) / f"{name}.json"
        result = json.loads(path.read_text()) if path.exists() else None
        rc, limit = int(rc), float(limit)
        if result is None:
            why = (f"over its {limit:.0f} s limit (killed)" if rc in (124, 137) else
                   "not run: the 9-minute budget was spent" if rc == -1 else f"exit {rc} without a result")
            result = {"status": "skip" if rc == -1 else "fail", "figure": "", "reason": f"{why}; see {log}",
                      "details": {}}
        elif rc not in (0, -1) and result["status"] == "pass":
            result = {**result, "status": "fail", "reason": f"exit {rc} after its result; see {log}"}
        rows.append({"step": name, "status": result["status"], "seconds": float(seconds), "limit_s": limit,
                     "figure": result["figure"], "reason": result["reason"], "log": log,
                     "details": result.get("details", {})})
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip")}
    total = time.time() - a.started
    summary = {"mode": a.mode, "note": a.note, "budget_s": a.budget, "total_s": round(total, 1),
               "counts": counts, "steps": rows,
               "files": sorted({r["log"] for r in rows} | {"summary.json"})}
    table = format_table(rows)
    summary["table"] = table
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print()
    print(table)
    word = "FAILED" if counts["fail"] else "PASSED"
    print(f"\nGPU CHECK {word} ({a.mode}): {counts['pass']} passed, {counts['fail']} failed, "
          f"{counts['skip']} skipped in {total:.0f} s of {a.budget:.0f}; logs and summary.json in {a.out}")
    return 1 if counts["fail"] else 0


def format_table(rows: list[dict]) -> str:
    def cut(s: str, n: int) -> str:
        s = " ".join(str(s).split())
        return s if len(s) <= n else s[:n - 1] + "…"
    lines = [f"{'step':<16} {'status':<6} {'seconds':>7}  {'key figure':<58} reason"]
    for r in rows:
        lines.append(f"{r['step']:<16} {r['status']:<6} {r['seconds']:>7.1f}  {cut(r['figure'], 58):<58} "
                     f"{cut(r['reason'], 160)}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["verdict"]:
        sys.exit(verdict(sys.argv[2:]))
    sys.exit("usage: common.py verdict --scratch DIR --out DIR --mode gpu|dry --budget S --started EPOCH")
