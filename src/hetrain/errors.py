"""Errors a user can act on: each says what was wrong and how to fix it.

`UsageError` is bad input (a flag, a spec, a config value): the CLI prints it as one line and
exits 2, without a traceback. `HetrainError` is anything else hetrain detected and can explain.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HetrainError(Exception):
    """A problem hetrain can explain: `what` went wrong and the `fix`."""

    exit_code = 1

    def __init__(self, what: str, fix: str | None = None):
        self.what = what
        self.fix = fix
        super().__init__(what if not fix else f"{what} — fix: {fix}")


class UsageError(HetrainError, ValueError):
    """Bad input from the user (exit code 2 on the command line)."""

    exit_code = 2


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """' (did you mean: a, b?)' for close names, or '' when nothing is close."""
    close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(close)}?)" if close else ""
