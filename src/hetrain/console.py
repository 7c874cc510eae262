"""The one way hetrain makes a rich Console, for the commands and for the ranks' log.

On a terminal rich fits output to the window. Anywhere else (a log file, a pipe, CI, a test
capturing output) rich has no window and falls back to 80 columns (or $COLUMNS), and a table of
per-device figures then wraps each row over several lines, "a100-80g#0 (emulated)" split in
three: unreadable and ungreppable. So off a terminal the width is at least PIPED_WIDTH, which
holds every table hetrain prints on one line per row; text lines are never wrapped (soft_wrap).
Here in the package root, not in cli/, because the ranks' log (runtime/ranks/log.py) uses it too
and a worker must not import the command line's modules.
"""

from __future__ import annotations

import os

from rich.console import Console

PIPED_WIDTH = 200


def console(*, stderr: bool = False, highlight: bool = False, soft_wrap: bool = True) -> Console:
    """A Console on stdout (or stderr): the terminal's width on a terminal, else at least
    PIPED_WIDTH columns (more if $COLUMNS says so)."""
    made = Console(stderr=stderr, highlight=highlight, soft_wrap=soft_wrap)
    if made.is_terminal:
        return made
    return Console(stderr=stderr, highlight=highlight, soft_wrap=soft_wrap, width=piped_width())


def piped_width() -> int:
    columns = os.environ.get("COLUMNS", "")
    return max(int(columns) if columns.isdigit() else 0, PIPED_WIDTH)
