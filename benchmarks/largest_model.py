"""The largest model a strategy trains on the emulated pair, found by training it (memory.py,
capacity_full.py share this): each candidate width runs as a real 2-process job under torchrun, and
a width "fits" when both ranks finish; an emulated OOM on any rank means it does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# -- inside each worker process ----------------------------------------------------------------
def report(ht, rank: int, out_dir: str, train) -> None:
    """Run `train()` (returns this rank's figures), write rank{R}.json with its status, and leave:
    cleanly when it trained, at once when it did not (peers may be gone: no teardown barrier)."""
    import torch

    import hetrain

    result = {"rank": rank, "status": "ok"}
    try:
        result.update(train())
    except torch.OutOfMemoryError as e:
        result = {"rank": rank, "status": "oom", "error": str(e)[:300]}
    except hetrain.HetrainError as e:
        if "out of memory" not in e.what and "does not fit" not in e.what:
            raise
        result = {"rank": rank, "status": "oom", "error": e.what[:300]}
    except RuntimeError as e:     # a peer ran out of memory and left: gloo reports the lost connection
        result = {"rank": rank, "status": "peer-failed", "error": str(e)[:300]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    if result["status"] == "ok":
        ht.close()
    else:
        os._exit(3)


# -- the driver --------------------------------------------------------------------------------
def trial(script: str, worker_args: list[str], label: str) -> dict:
    """`script --worker ... --out DIR` on 2 fresh processes: {'fits': True, rank 0's figures...} or
    {'fits': False, 'oom_rank', 'error'}; anything but success or an OOM raises."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script,
               *worker_args, "--out", tmp]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=600)
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    statuses = [r["status"] for r in results]
    if proc.returncode == 0 and statuses == ["ok", "ok"]:
        return {"fits": True, **results[0]}
    if "oom" in statuses:
        oom = next(r for r in results if r["status"] == "oom")
        return {"fits": False, "oom_rank": oom["rank"], "error": oom["error"]}
    raise RuntimeError(f"{label}: neither trained nor ran out of memory (exit {proc.returncode}, {statuses}):\n"
                       f"{proc.stderr[-3000:]}")


def largest(run, label: str, lo: int, hi: int, step: int, n_params, log) -> tuple[int, dict, list[dict]]:
    """Binary search over widths lo..hi (multiples of `step`) for the largest `run(width)` fits:
    (width, its result, every width tried)."""
    tried, best, best_result = [], None, None
    a, b = lo // step, hi // step
    while a <= b:
        mid = (a + b) // 2
        width, t0 = mid * step, time.perf_counter()
        r = run(width)
        tried.append({"width": width, "params": n_params(width), "trains": r["fits"]})
        log(f"  {label:<14} width {width:>4} ({n_params(width) / 1e6:5.2f}M params): "
            f"{'trains' if r['fits'] else 'out of memory on rank ' + str(r['oom_rank'])}  "
            f"[{time.perf_counter() - t0:.0f} s]")
        if r["fits"]:
            best, best_result, a = width, r, mid + 1
        else:
            b = mid - 1
    if best is None:
        raise RuntimeError(f"{label}: even width {lo} does not train")
    return best, best_result, tried
