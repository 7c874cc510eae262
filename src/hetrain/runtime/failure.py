"""How a worker stops on an error hetrain can explain: one line with the fix, no traceback.

Installed by init() in every worker. A UsageError is the same on every rank, so rank 0 alone
prints it, and the process exits with code 2, which `hetrain run` reads as a usage error.
An out-of-memory error that escaped the training loop is recorded in the checkpoint directory,
so the restarted job runs that rank with half the micro-batch (recovery.py).
Anything else keeps Python's usual traceback, tagged with the rank.
"""

from __future__ import annotations

import os
import sys

from ..errors import HetrainError, UsageError


def install_excepthook(engine) -> None:
    previous = sys.excepthook
    rank, world_size = engine.rank, engine.world_size

    def hook(exc_type, exc, tb):
        import torch

        from .recovery import record_escaped_oom

        if isinstance(exc, torch.OutOfMemoryError) and engine._checkpointer is not None:
            record_escaped_oom(str(engine._checkpointer.dir), rank=rank, step=engine.steps_done,
                               micro=engine.current_micro_batch or 1)
        if isinstance(exc, HetrainError):
            if rank == 0 or not isinstance(exc, UsageError):
                tag = f" (rank {rank})" if world_size > 1 and not isinstance(exc, UsageError) else ""
                print(f"hetrain: error{tag}: {exc.what}", file=sys.stderr)
                if exc.fix:
                    print(f"  fix: {exc.fix}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exc.exit_code)   # skip teardown: peers may already be gone
        if world_size > 1:
            print(f"[rank {rank}] {exc_type.__name__} in the training script:", file=sys.stderr)
        previous(exc_type, exc, tb)

    sys.excepthook = hook
