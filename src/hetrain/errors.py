"""Errors a user can act on: each says what was wrong and how to fix it.

`UsageError` is bad input (a flag, a spec, a config value): the CLI prints it as one line and
exits 2, without a traceback. `HetrainError` is anything else hetrain detected and can explain.
`restartable` says whether `--max-restarts` may try again: a restart cannot fix bad input, a model
that does not fit, or a preemption (launch.py stops restarting on those).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HetrainError(Exception):
    """A problem hetrain can explain: `what` went wrong and the `fix`."""

    exit_code = 1
    restartable = True      # a torchrun restart may get past it (a crash, a hang, a lost peer)
    agreed = False          # raised by every rank together, with the same text (printed once)

    def __init__(self, what: str, fix: str | None = None):
        self.what = what
        self.fix = fix
        super().__init__(what if not fix else f"{what} — fix: {fix}")


class UsageError(HetrainError, ValueError):
    """Bad input from the user (exit code 2 on the command line)."""

    exit_code = 2
    restartable = False
    agreed = True


class DoesNotFit(HetrainError):
    """The model does not fit a device even at a micro-batch of one sample: the same on a restart."""

    restartable = False
    agreed = True


class Preempted(HetrainError):
    """The job stopped on SIGTERM/SIGINT at a step boundary (runtime/resilience/preempt.py). Exit
    code 75 (EX_TEMPFAIL: try again later), so a batch script can tell it from a failure and requeue."""

    exit_code = 75
    restartable = False
    agreed = True


def say(what: str, fix: str | None = None, *, tag: str = "", error: bool = True) -> None:
    """The one way hetrain tells a person about an error, on stderr: `hetrain: error[ (rank N)]: WHAT`
    then `  fix: FIX`. A preemption is not an error: `hetrain: WHAT`."""
    import sys

    print(f"hetrain: error{tag}: {what}" if error else f"hetrain: {what}", file=sys.stderr)
    if fix:
        print(f"  fix: {fix}", file=sys.stderr)


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """' (did you mean: a, b?)' for close names, or '' when nothing is close."""
    close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""
