"""Several scripts' refusals in the ranks of one process group (tests/harness.py run_ranks), one
after another: a group per job size instead of one per case, each forked rank paying its start
once. Each case runs as init_errors.raise_case runs it alone, then the process group it joined is
left, so the next case's hetrain.init() joins afresh."""

from __future__ import annotations

import os


def raise_cases(rank: int, world: int, cases: list[tuple]) -> list:
    """`cases`: (code, cwd, environment variables[, argv]) each; returns raise_case's answer for
    each, in order."""
    import torch.distributed as dist

    from init_errors import raise_case

    answers = []
    for code, cwd, env, *argv in cases:
        os.environ.update(env)
        answers.append(raise_case(rank, world, code, cwd, *argv))
        if dist.is_initialized():
            dist.destroy_process_group()
    return answers
