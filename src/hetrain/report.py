"""What people see during and after a run: a progress bar on rank 0 and a metrics file."""

from __future__ import annotations

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .console import console
from .files import write_json_atomic

LINE_EVERY_S = 5.0      # off a terminal: one progress line at most this often (and the last step's)


class StepProgress:
    """`with StepProgress(ht, total) as bar: ... bar.update(step)` — on rank 0 only, with the
    global-batch loss and the whole job's samples/s (not one rank's). On a terminal, a bar; in a
    log file or pipe, rich's bar would show nothing until the end and then one line, so there a
    plain line every LINE_EVERY_S seconds instead. `on`: whether to show it (default: rank 0 of a
    verbose job)."""

    def __init__(self, ht, total: int, description: str = "training", *, on: bool | None = None,
                 every_s: float = LINE_EVERY_S):
        self._on = (ht.is_main and ht.config.reporting.verbose) if on is None else on
        self._total = total
        self._description = description
        self._every_s = every_s
        self._progress: Progress | None = None
        self._console = None
        self._done = 0
        self._last_line = 0.0

    def __enter__(self) -> StepProgress:
        if not self._on:
            return self
        self._console = console()
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[sps]} samples/s"),
                TimeRemainingColumn(), console=self._console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task(self._description, total=self._total, loss="-", sps="-")
        else:
            self._last_line = time.monotonic()
        return self

    def update(self, step) -> None:
        if not self._on:
            return
        self._done += 1
        loss, sps = f"{step.loss:.3f}", f"{step.samples_per_s:.0f}"
        if self._progress is not None:
            self._progress.update(self._task, advance=1, loss=loss, sps=sps)
            return
        now = time.monotonic()
        if now - self._last_line >= self._every_s or self._done == self._total:
            self._last_line = now
            self._console.print(f"{self._description} step {self._done}/{self._total}  loss {loss}  "
                                f"{sps} samples/s", markup=False)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


def write_json(path: str, data: dict) -> None:
    """Write aside, then rename: a crash never leaves a half-written file."""
    write_json_atomic(path, data)
