"""Logs go through rank 0; per-rank values are shown side by side in one table."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table


def _console() -> Console:
    """Rich's console; 120 columns when output goes to a file or pipe (not 80), so tables of
    per-rank figures stay one row per rank in logs."""
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, soft_wrap=True, width=120)
    return console


class RankLog:
    def __init__(self, *, rank: int, verbose: bool = True):
        self.rank = rank
        self.enabled = verbose and rank == 0
        self.console = _console() if rank == 0 else None

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False)

    def warn(self, message: str) -> None:
        """Warnings print on rank 0 even when not verbose."""
        if self.console is not None:
            self.console.print(f"warning: {message}", style="yellow", markup=False)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        if not self.enabled:
            return
        t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        for c in columns:
            t.add_column(c, overflow="fold")
        for row in rows:
            t.add_row(*(str(v) for v in row))
        self.console.print(t)
