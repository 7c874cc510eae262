"""The one way hetrain makes a rich Console, for the commands and for the ranks' log.

On a terminal rich fits output to the window. Anywhere else (a log file, a pipe, CI, a test
capturing output) rich has no window and falls back to 80 columns (or $COLUMNS), and a table of
per-device figures then wraps each row over several lines, "a100-80g#0 (rank 0)" split in
three: unreadable and ungreppable. So off a terminal the width is at least PIPED_WIDTH, which
holds most of hetrain's tables with one line per row, and a wider table (a long reason in a cell)
is printed at its own width (LogConsole); text lines are never wrapped (soft_wrap).
Here in the package root, not in cli/, because the ranks' log (runtime/ranks/log.py) uses it too
and a worker must not import the command line's modules.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

PIPED_WIDTH = 200
MAX_WIDTH = 1000        # a table wider than this (a pathological cell) folds after all


def console(*, stderr: bool = False, highlight: bool = False, soft_wrap: bool = True) -> Console:
    """A Console on stdout (or stderr): the terminal's width on a terminal, else at least
    PIPED_WIDTH columns (more if $COLUMNS says so), widened for a table that needs more."""
    made = Console(stderr=stderr, highlight=highlight, soft_wrap=soft_wrap)
    if made.is_terminal:
        return made
    return LogConsole(stderr=stderr, highlight=highlight, soft_wrap=soft_wrap, width=piped_width())


def piped_width() -> int:
    columns = os.environ.get("COLUMNS", "")
    return max(int(columns) if columns.isdigit() else 0, PIPED_WIDTH)


class LogConsole(Console):
    """Off a terminal: a table wider than the console (a long reason in one cell) is printed at
    its own width rather than folded, so each of its rows stays one line in the log. Not a table
    drawn with lines between its rows (doctor's findings, whose cells are paragraphs): each of its
    rows is boxed, so a folded cell stays readable, and at its own width it would be ~950 columns."""

    def print(self, *objects, **kwargs) -> None:
        tables = [o for o in objects if isinstance(o, Table) and not o.show_lines]
        needed = max((Measurement.get(self, self.options.update_width(MAX_WIDTH), t).maximum for t in tables),
                     default=0)
        if needed <= self.width:
            return super().print(*objects, **kwargs)
        width = self.width
        self.width = needed
        try:
            super().print(*objects, **kwargs)
        finally:
            self.width = width
