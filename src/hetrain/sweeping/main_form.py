"""A stock Optuna script run as written: `hetrain sweep script.py` runs its
`if __name__ == "__main__":` block with optuna.create_study and Study.optimize taken over.

  create_study  makes the sweep's study (its SQLite --storage; the script's study_name unless
                --study is given) with the script's direction, sampler and pruner (Optuna's own
                MedianPruner where it gives none, as create_study does); --direction that says
                otherwise is one line; --pruner given replaces the script's pruner.
  optimize      runs n_trials trials (or until its timeout; --trials replaces n_trials) over the
                devices, the function it is handed run in the workers, which import the file: that
                function must be defined at the file's top level. Its callbacks are called after
                each trial, as Optuna calls them, and study.stop() (a callback's, GridSampler's when
                its grid is used up, the objective's) stops the asking. A failed trial is counted
                and the sweep goes on (`catch` is not needed); n_jobs is the devices'.

The study handed back is a real Optuna Study on the sweep's storage, so what the script does
after optimize (study.best_trial, study.trials_dataframe(), its prints) reads the sweep's trials.
As with --trials, n_trials is what the study should have finished, so the same command resumes a
killed sweep; a second optimize call in the script runs n_trials more.
"""

from __future__ import annotations

import pickle
import runpy
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..errors import UsageError
from .objective import load_objective
from .runner import DIRECTIONS, Sweep, SweepResult, SweepSetup


def _direction(value) -> str:
    return value.name.lower() if hasattr(value, "name") else str(value).lower()


class MainRun:
    def __init__(self, setup: SweepSetup, *, given: set[str], say: Callable[[str], None],
                 report: Callable[[SweepResult], None]):
        """`given`: which of trials, direction, pruner, study the command line set."""
        self.setup, self.given, self.say, self.report = setup, given, say, report
        self.file = Path(setup.objective).name
        self.sweep: Sweep | None = None
        self.calls = 0
        self.saved: dict = {}

    def create_study(self, *, storage=None, sampler=None, pruner=None, study_name=None, direction=None,
                     load_if_exists=False, directions=None):
        import optuna

        if self.sweep is not None:
            raise UsageError(f"hetrain sweep: {self.file}'s __main__ creates a second study",
                             "create one study in the file (hetrain sweep runs one), or sweep each from a file of its own")
        wanted = [_direction(d) for d in (directions or [direction or "minimize"])]
        if len(wanted) > 1:
            raise UsageError(f"hetrain sweep: {self.file} creates a multi-objective study (directions={wanted})",
                             "hetrain sweep runs single-objective studies: give create_study one direction=")
        if wanted[0] not in DIRECTIONS:
            raise UsageError(f"hetrain sweep: {self.file}: create_study(direction={wanted[0]!r})",
                             f"give direction= one of {', '.join(DIRECTIONS)}")
        if "direction" in self.given and self.setup.direction != wanted[0]:
            raise UsageError(f"--direction {self.setup.direction}, but {self.file}'s create_study says "
                             f"direction={wanted[0]!r}", "drop --direction: the script's direction is used")
        if storage is not None:
            self.say(f"the study lives in --storage {self.setup.storage}, not in the script's storage")
        try:
            parts = pickle.dumps((sampler, None if "pruner" in self.given else pruner or optuna.pruners.MedianPruner()))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise UsageError(f"hetrain sweep: {self.file}'s sampler or pruner cannot be sent to the device "
                             f"workers ({e})".splitlines()[0], "define its class at the file's top level, or use "
                             "one of Optuna's") from None
        name = self.setup.study if "study" in self.given or not study_name else study_name
        self.setup = replace(self.setup, direction=wanted[0], parts=parts, study=name)
        with self.unpatched():
            self.sweep = Sweep(self.setup, self.say)
        return self.sweep.study

    def optimize(self, study, func, n_trials=None, timeout=None, n_jobs=1, catch=(), callbacks=None,
                 gc_after_trial=False, show_progress_bar=False):
        if self.sweep is None or study is not self.sweep.study:       # a study not made by create_study
            return self.saved["optimize"](study, func, n_trials, timeout, n_jobs, catch, callbacks,
                                          gc_after_trial, show_progress_bar)
        module = load_objective(self.setup.objective)
        name = getattr(func, "__name__", None)
        if not name or getattr(func, "__qualname__", None) != name or not callable(getattr(module, name, None)):
            raise UsageError(f"hetrain sweep: {self.file}'s study.optimize is handed {func!r}, not a function defined "
                             "at the file's top level", "define `def objective(trial):` at the top of the file and "
                             "pass it: study.optimize(objective, ...) (each device's worker imports it by name)")
        if "trials" in self.given:
            trials = self.setup.trials
        elif n_trials is not None:
            trials = n_trials if not self.calls else self.sweep.finished() + n_trials
        elif timeout is None:
            raise UsageError(f"hetrain sweep: {self.file}'s study.optimize gives neither n_trials nor timeout",
                             "pass --trials N: the sweep stops when the study has N finished trials")
        else:
            trials = None
        self.calls += 1
        setup = replace(self.setup, entry=name, trials=trials, timeout=timeout)
        with self.unpatched():
            result = self.sweep.run(setup, module, callbacks=callbacks or ())
        self.report(result)

    def patch(self) -> None:
        import optuna
        import optuna.study

        self.saved = {"optuna": optuna.create_study, "study": optuna.study.create_study,
                      "optimize": optuna.study.Study.optimize}
        optuna.create_study = optuna.study.create_study = self.create_study
        optuna.study.Study.optimize = lambda study, *args, **kwargs: self.optimize(study, *args, **kwargs)

    def restore(self) -> None:
        import optuna
        import optuna.study

        if self.saved:
            optuna.create_study, optuna.study.create_study = self.saved["optuna"], self.saved["study"]
            optuna.study.Study.optimize = self.saved["optimize"]

    def unpatched(self):
        """Optuna as it is, while the sweep itself makes and runs the study."""
        run = self

        class Unpatched:
            def __enter__(self):
                run.restore()

            def __exit__(self, *exc):
                run.patch()

        return Unpatched()

    def run(self) -> None:
        """The file's __main__, run with the study taken over; the storage freed after."""
        argv, sys.argv = sys.argv, [self.setup.objective]
        self.patch()
        try:
            runpy.run_path(self.setup.objective, run_name="__main__")
        finally:
            self.restore()
            sys.argv = argv
            if self.sweep is not None:
                self.sweep.close()
        if not self.calls:
            raise UsageError(f"hetrain sweep: {self.file}'s __main__ ran without calling study.optimize on the study "
                             "it created", "call study.optimize(objective, n_trials=...) under "
                             "`if __name__ == \"__main__\":`")
