"""Logs go through rank 0; per-rank values are shown side by side in one table.

Warnings come from any rank. Each rank holds its own until the ranks next meet: the step's
agreement table carries every rank's count of held warnings, and when any rank holds one, all
ranks gather them (one all_gather_object) and rank 0 prints each once, naming the ranks; the same
text from several ranks is one line ("warning (ranks 0, 1): ..."). prepare(), summary() and
close() meet too, so no warning waits longer than a step. A rank that stops on an error prints
what it still holds itself (runtime/resilience/worker_errors.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from ...console import console


def _console() -> Console:
    """hetrain's console (hetrain/console.py): wide when output goes to a file or pipe, so tables
    of per-rank figures stay one row per rank in logs."""
    return console()


def merge_warnings(per_rank: Sequence[Sequence[str]]) -> list[str]:
    """One line per distinct warning, in first-seen order, naming every rank that raised it."""
    ranks: dict[str, list[int]] = {}
    for rank, messages in enumerate(per_rank):
        for m in messages:
            who = ranks.setdefault(m, [])
            if rank not in who:
                who.append(rank)
    out = []
    for m, who in ranks.items():
        tag = f"rank {who[0]}" if len(who) == 1 else "ranks " + ", ".join(map(str, who))
        out.append(f"warning ({tag}): {m}")
    return out


class RankLog:
    def __init__(self, *, rank: int, world_size: int = 1, verbose: bool = True, details: bool = False):
        self.rank = rank
        self.world_size = world_size
        self.enabled = verbose and rank == 0
        self.details = details            # Reporting.details: the reasons behind the compact plan too
        self.console = _console() if rank == 0 else None
        self.held: list[str] = []          # warnings not yet printed by rank 0

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False)

    def detail(self, message: str) -> None:
        """A reason or a measurement a person reads only when asking why (`--verbose`): by default
        the output before training is the plan's table and its one summary line."""
        if self.details:
            self.info(message)

    def warn_job(self, message: str) -> None:
        """A warning every rank knows identically (an agreed skip, a plan note): rank 0 prints it
        now, untagged; the other ranks need not call it. Printed even when not verbose."""
        self._print_warnings([f"warning: {message}"])

    def warn(self, message: str) -> None:
        """This rank's own warning: printed once by rank 0, with the rank named, at the ranks'
        next meeting (flush); even when not verbose."""
        if self.world_size == 1:
            self._print_warnings([f"warning: {message}"])
        else:
            self.held.append(message)

    @property
    def pending(self) -> int:
        return len(self.held)

    def flush(self) -> None:
        """A collective: every rank's held warnings, printed once by rank 0."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, list(self.held))
        self.held.clear()
        self._print_warnings(merge_warnings(gathered))

    def flush_if(self, table) -> None:
        """After the step's agreement: flush when any rank holds a warning (all ranks see it)."""
        if self.world_size > 1 and table.any("warnings"):
            self.flush()

    def flush_alone(self) -> None:
        """This rank is stopping on its own (an error): print what it holds, tagged, to stderr."""
        for m in self.held:
            print(f"warning (rank {self.rank}): {m}", file=sys.stderr)
        self.held.clear()

    def _print_warnings(self, lines: Sequence[str]) -> None:
        if self.console is not None:
            for line in lines:
                self.console.print(line, style="yellow", markup=False)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], *,
              detail: bool = False) -> None:
        """`detail`: printed only with the details on, as detail() is."""
        if not self.enabled or (detail and not self.details):
            return
        t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        for c in columns:
            t.add_column(c, overflow="fold")
        for row in rows:
            t.add_row(*(str(v) for v in row))
        self.console.print(t)
