"""Run a function on W real processes joined in a gloo process group on loopback.

Each rank is a fresh process with the torchrun environment variables set, so the code under test
joins the group exactly as it does under torchrun. The processes are forked from a `forkserver`
that has imported torch, torch._dynamo and hetrain's runtime (and nothing else: it never runs a
test, starts a thread or touches CUDA), not `spawn`ed: each rank would otherwise import them again,
~4-6 s of CPU a rank on a 2-core machine, which is most of a small distributed test. A rank that raises, hangs past
the deadline, or dies at exit (e.g. gloo's SIGABRT at teardown) fails the test, with every rank's
error shown side by side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, caller_env: dict, env: dict, out: str) -> None:
    # A forked rank has the fork server's environment, from when it started: make it the caller's
    # now, as a spawned one would have (a test's monkeypatch.setenv must reach its ranks).
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1", **env})
    # A rank of the fork server inherits its start method ('forkserver'): a DataLoader's workers
    # would then start through a fork server of the rank's own, importing torch anew (8 s a rank,
    # measured on a busy 2-core host). torchrun's ranks fork their workers (Linux's default): so do these.
    mp.set_start_method("fork", force=True)
    import torch

    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pkl"
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)
    if result[0] == "error":
        os._exit(1)


# What the fork server imports once. hetrain reads its environment when a job starts, not on import,
# so the variables each rank sets in _entry still reach it. torch._dynamo because torch's optimizers
# import it on their first step (optim/optimizer.py, _use_grad_for_differentiable): ~1 s of CPU a
# rank, and tests/dist took 118-122 s without it in the preload against 66 s with it (one host, quiet).
# The integrations' libraries too: a rank of a Hugging Face or Lightning test imported them again,
# ~3-6 s of CPU a rank (GPT-2's and Llama's modeling 2.7 s, the Trainer 1.3 s, Fabric 2 s, measured
# here), paid once by the server instead. Only the libraries' own modules: hetrain's integrations
# swap classes at import, which each test must see happen. One that is not installed is skipped
# (the fork server ignores a preload's ImportError).
# torch's pipelining (~0.5 s of CPU to import: it registers its fake ops) and distributed checkpoint
# modules too, imported by every pipeline's and every checkpointing job's ranks. rank_heap last.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hetrain.runtime.engine",
           "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
           "transformers.trainer", "lightning.fabric", "rank_heap"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)     # used when the server starts: the first run_ranks
    return ctx


def run_ranks(fn, world: int, *args, timeout: float = 180.0, env: dict | None = None,
              rank_env: dict[int, dict] | None = None) -> list:
    """fn(rank, world, *args) on `world` processes; returns each rank's return value.
    `env`: variables for every rank; `rank_env`: {rank: variables} on top, e.g. GROUP_RANK to
    place ranks on different (loopback) nodes as torchrun's multi-node launch would."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, dict(os.environ),
                                                  {**(env or {}), **(rank_env or {}).get(r, {})}, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, problems = [], []
        for r, p in enumerate(procs):
            path = Path(out) / f"rank{r}.pkl"
            status, value = pickle.loads(path.read_bytes()) if path.exists() else ("missing", None)
            if r in hung:
                problems.append(f"rank {r}: hung past the {timeout:.0f} s deadline (status {status})")
            elif status == "error":
                problems.append(f"rank {r}: raised\n{value}")
            elif p.exitcode != 0:
                problems.append(f"rank {r}: exit code {p.exitcode} after returning {status}")
            results.append(value)
        if problems:
            raise AssertionError("distributed run failed:\n" + "\n".join(problems))
        return results
