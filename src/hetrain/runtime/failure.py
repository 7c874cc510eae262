"""How a worker stops on an error hetrain can explain: one line with the fix, no traceback.

Installed by init() in every worker. A UsageError is the same on every rank, so rank 0 alone
prints it, and the process exits with code 2, which `hetrain run` reads as a usage error.
Anything else keeps Python's usual traceback, tagged with the rank.
"""

from __future__ import annotations

import os
import sys

from ..errors import HetrainError, UsageError


def install_excepthook(rank: int, world_size: int) -> None:
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
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
