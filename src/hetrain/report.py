"""What people see during and after a run: a progress bar on rank 0 and a metrics file."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .files import write_json_atomic


class StepProgress:
    """`with StepProgress(ht, total) as bar: ... bar.update(step)` — a bar on rank 0 only, with
    the global-batch loss and the whole job's samples/s (not one rank's)."""

    def __init__(self, ht, total: int, description: str = "training"):
        self._on = ht.is_main and ht.config.verbose
        self._total = total
        self._description = description
        self._progress: Progress | None = None

    def __enter__(self) -> StepProgress:
        if self._on:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[sps]} samples/s"),
                TimeRemainingColumn(), transient=False)
            self._progress.start()
            self._task = self._progress.add_task(self._description, total=self._total, loss="-", sps="-")
        return self

    def update(self, step) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, loss=f"{step.loss:.3f}",
                                  sps=f"{step.samples_per_s:.0f}")
            if not self._progress.console.is_terminal and (step.index + 1) % max(self._total // 10, 1) == 0:
                self._progress.refresh()

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


def write_json(path: str, data: dict) -> None:
    """Write aside, then rename: a crash never leaves a half-written file."""
    write_json_atomic(path, data)
