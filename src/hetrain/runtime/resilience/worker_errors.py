"""How a worker stops on an error hetrain can explain: one line with the fix, no traceback.

Installed by init() in every worker. Under `hetrain run` a worker does not print the error: it
writes it to the run directory and exits (code 2 for a usage error), and the launcher prints it
once — whichever ranks got there before torchrun stopped the others — and stops restarting when
the error is one a restart cannot fix (`restartable`). Under plain torchrun, rank 0 prints an error
every rank raised together (`agreed`: bad input, a preemption) and every rank prints any other.
An out-of-memory error that escaped the training loop is recorded in the checkpoint directory,
so the restarted job runs that rank with half the micro-batch (runtime/resilience/oom.py).
Anything else keeps Python's usual traceback, tagged with the rank.
"""

from __future__ import annotations

import json
import os
import sys

from ...errors import HetrainError, Preempted, say
from ...files import write_json_atomic
from ..config import LAUNCH_ENV

ERROR_FILE = "error-rank{rank}.json"


def write_error(run_dir: str, rank: int, exc: HetrainError) -> None:
    path = os.path.join(run_dir, ERROR_FILE.format(rank=rank))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    write_json_atomic(path, {"rank": rank, "attempt": attempt, "what": exc.what, "fix": exc.fix,
                             "exit_code": exc.exit_code, "agreed": exc.agreed, "restartable": exc.restartable,
                             "kind": type(exc).__name__})


def report_and_exit(exc: HetrainError, *, rank: int, world_size: int = 1) -> None:
    """Say a HetrainError the way this job says it, then leave at once with its exit code (no
    teardown: peers may already be gone). Under `hetrain run` the error goes to the run directory
    and the launcher prints it once; else rank 0 prints an error every rank raised together, and
    every rank prints its own."""
    launch = os.environ.get(LAUNCH_ENV)
    run_dir = os.path.dirname(launch) if launch else None
    if run_dir is not None and os.path.isdir(run_dir):
        write_error(run_dir, rank, exc)
    elif rank == 0 or not exc.agreed:
        say(exc.what, exc.fix, tag=f" (rank {rank})" if world_size > 1 and not exc.agreed else "",
            error=not isinstance(exc, Preempted))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exc.exit_code)


def read_errors(run_dir: str) -> list[dict]:
    """The errors workers wrote in the job's latest attempt, lowest rank first."""
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("error-rank") and name.endswith(".json"):
            with open(os.path.join(run_dir, name)) as f:
                out.append(json.load(f))
    latest = max((e.get("attempt", 0) for e in out), default=0)
    return sorted((e for e in out if e.get("attempt", 0) == latest), key=lambda e: e["rank"])


def clear_errors(run_dir: str) -> None:
    """Before a launch: errors of an earlier job in the same run directory are not this one's."""
    for name in os.listdir(run_dir):
        if name.startswith("error-rank") and name.endswith(".json"):
            os.remove(os.path.join(run_dir, name))


def install_excepthook(rank: int, world_size: int, job_of) -> None:
    """Installed as soon as the rank knows who it is, before anything else can fail. `job_of()`
    gives the job record (job.py) once it exists, read when an error arrives: its checkpoint dir,
    step and micro-batch for an escaped OOM, and the warnings its log still holds. A second
    install (init() installs one before the rank is known, the Engine one after) replaces the first
    instead of chaining to it."""
    previous = getattr(sys.excepthook, "hetrain_previous", sys.excepthook)

    def hook(exc_type, exc, tb):
        import torch

        from .oom import record_escaped_oom

        job = job_of()
        if job is not None:
            job.log.flush_alone()   # this rank's warnings that rank 0 has not printed yet
        if isinstance(exc, torch.OutOfMemoryError) and job is not None and job.checkpointer is not None:
            record_escaped_oom(str(job.checkpointer.dir), rank=rank, step=job.steps_done,
                               micro=job.micro_batch or 1)
        if isinstance(exc, HetrainError):
            report_and_exit(exc, rank=rank, world_size=world_size)
        if world_size > 1 and _peer_lost(exc):
            # Expected when a rank or a node dies: its peers' collective fails on the closed
            # connection. One line, not a traceback; the launcher restarts (or stops) the job.
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"[rank {rank}] a peer left during a collective ({first.split('] ', 1)[-1][:160]}): "
                  "a rank or node was lost; the job restarts from its last checkpoint if --max-restarts allows",
                  file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
        if world_size > 1:
            print(f"[rank {rank}] {exc_type.__name__} in the training script:", file=sys.stderr)
        previous(exc_type, exc, tb)

    hook.hetrain_previous = previous
    sys.excepthook = hook


def install_import_hook() -> None:
    """Installed at `import hetrain`: a HetrainError raised before init() installs its hook is one
    line (or, under `hetrain run`, the launcher's one line) too. A script builds its configuration
    groups before calling init(), and each group checks itself when made: `Checkpoints(every=-3)`
    must not be a traceback where `hetrain.init(global_batch=-1)` is one line. Anything else goes to
    the hook there was; init() replaces this one (`hetrain_previous`)."""
    if hasattr(sys.excepthook, "hetrain_previous"):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if isinstance(exc, HetrainError):
            report_and_exit(exc, rank=_env_int("RANK", 0), world_size=_env_int("WORLD_SIZE", 1))
        previous(exc_type, exc, tb)

    hook.hetrain_previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:      # a junk RANK is init()'s error to name; here the error at hand is said
        return default


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_lost(exc: BaseException) -> bool:
    """A collective that failed because the other end went away (gloo's words for it)."""
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in PEER_LOST)
