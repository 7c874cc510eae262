"""The user's objective file, and what each trial is handed.

    # sweep.py
    def space(trial):                 # Optuna's suggestions: the trial's hyperparameters
        return {"width": trial.suggest_categorical("width", [64, 256]), "lr": trial.suggest_float(...)}
    def memory(params):               # optional: what the planner's memory model needs
        return {"params": 12 * params["width"] ** 2, "batch": 32, "activation_bytes_per_sample": 4e4}
    def train(params, ctx):           # runs on ctx.device; returns the value to optimize
        for step in range(100):
            with ctx.compute(samples=32):   # at the device's speed (a no-op on a GPU)
                loss = ...
            ctx.report(loss, step)          # intermediate value: the pruner may stop the trial here
        return loss

`space` runs in the scheduler (it asks Optuna for every trial), `train` in the worker process of
the device the trial was placed on (a CPU device's process may be set up for it: one thread).

Or Optuna's own form, as written for `study.optimize`:

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        device = hetrain.sweep.device()          # or the worker's environment: HETRAIN_SWEEP_DEVICE
        ...
        trial.report(loss, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
        return loss

`objective` runs in the worker; its suggestions are made there the first time. Placement needs
the parameters before the trial runs: once a trial has finished, the scheduler samples the
parameters every finished trial had (the search space seen so far) before placing it and gives
them to the trial as `enqueue_trial` does, so `suggest_*` in the worker returns those same values
(asking.py). The
need is `memory(params)` where given, else the largest peak a finished trial was measured at;
until a trial has finished, one trial runs at a time on the largest device (the first measured
trial). A file defining both forms is run in the `space`/`train` form.

Or a stock Optuna script, as Optuna's examples are written: `objective(trial)` and, under
`if __name__ == "__main__":`, `study = optuna.create_study(direction=..., sampler=..., pruner=...)`
and `study.optimize(objective, n_trials=...)`. That block is run (main_form.py): the study is the
sweep's, with the script's direction, sampler and pruner, and optimize runs the trials over the
devices; what the script prints after (its best trial) is the sweep's.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..errors import UsageError

REQUIRED = ("space", "train")
FORMS = ("space/train", "objective")
NEITHER_FIX = ("define objective(trial) -> float and, as Optuna's examples do, under "
               "`if __name__ == \"__main__\":` study = optuna.create_study(...); study.optimize(objective, "
               "n_trials=...); or space(trial) -> dict and train(params, ctx) -> float (see `hetrain sweep --help`)")


def form_of(module: ModuleType, entry: str | None = None) -> str:
    """'space/train' when the file defines either of them, else 'objective' (load_objective has
    checked that one of the forms is whole); a stock script's optimize(func) is the objective form."""
    if entry is not None:
        return "objective"
    return "space/train" if any(callable(getattr(module, n, None)) for n in REQUIRED) else "objective"


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def main_creates_study(path: str | Path) -> bool:
    """Whether the file is a stock Optuna script: an `if __name__ == "__main__":` block, and a call
    of create_study in the file (in that block, or in a function it calls)."""
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return False
    if not any(_is_main_guard(node) for node in tree.body):
        return False
    return any(isinstance(n, ast.Call) and (getattr(n.func, "attr", None) == "create_study"
                                            or getattr(n.func, "id", None) == "create_study")
               for n in ast.walk(tree))


def load_objective(path: str) -> ModuleType:
    """The file as a module, with one whole form checked; `if __name__ == "__main__":` keeps
    anything else it runs out."""
    file = Path(path)
    if not file.is_file() or file.suffix != ".py":
        raise UsageError(f"hetrain sweep: {path!r} is not a Python file",
                         "give the objective file: a .py defining objective(trial), or space(trial) and "
                         "train(params, ctx)")
    sys.path.insert(0, str(file.resolve().parent))
    spec = importlib.util.spec_from_file_location(f"_hetrain_sweep_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    has = {name: callable(getattr(module, name, None)) for name in (*REQUIRED, "objective")}
    if not any(has.values()) and not main_creates_study(file):
        raise UsageError(f"hetrain sweep: {path!r} defines neither objective(trial) nor space(trial) and "
                         "train(params, ctx), and has no `if __name__ == \"__main__\":` that creates a study",
                         NEITHER_FIX)
    missing = [name for name in REQUIRED if not has[name]]
    if missing and len(missing) < len(REQUIRED):
        raise UsageError(f"hetrain sweep: {path!r} defines no {' and no '.join(missing)}()",
                         "define space(trial) -> dict of hyperparameters and train(params, ctx) -> float "
                         "(see `hetrain sweep --help`)")
    if hasattr(module, "memory") and not callable(module.memory):
        raise UsageError(f"hetrain sweep: {path!r}: memory is not a function", "define memory(params) -> dict, or drop it")
    return module


class Pruned(Exception):
    """Raised by TrialContext.report when the pruner stops the trial (optuna.TrialPruned in the
    worker is turned into this, so the runner needs no Optuna type to recognise it)."""


def on_gpu(target) -> bool:
    """Whether a sweep slot's target (runner.SweepSetup.targets) is a GPU, its CUDA index, rather
    than another kind of device, which answers for itself."""
    return isinstance(target, str)


@dataclass
class TrialContext:
    """What `train(params, ctx)` is handed."""

    number: int                      # the Optuna trial number
    params: dict
    device: str                      # torch device string: "cpu" or "cuda:0"
    label: str                       # the device's, e.g. "NVIDIA A100-SXM4-80GB#0"
    speed: float = 1.0               # the device's speed, relative to the catalog's 1.0
    sample_s: float | None = None    # a fixed clock: a compute of m samples lasts m·sample_s/speed
    # how a piece of compute is brought to the device's speed, at_speed(ctx, samples) (a context
    # manager, the device target's); None: the device computes at its own speed (a GPU)
    at_speed: Callable | None = None
    trial: object = None             # the worker's optuna.trial.Trial (report / should_prune)
    reports: int = 0
    compute_s: float = field(default=0.0)
    parent: int | None = None        # the scheduler's pid (a group's rank): the trial stops once it is gone
    # a worker's end of a pipe only the scheduler holds open: readable (at EOF) once it is gone
    lifeline: object = None
    # a group trial (a data-parallel job over several devices): this rank, the members' labels, the
    # sharding the memory model chose, and how the ranks agree on a decision (rank 0's, broadcast)
    rank: int = 0
    world_size: int = 1
    members: tuple[str, ...] = ()
    sharding: str | None = None
    agree: Callable[[bool], bool] | None = None

    @property
    def group(self) -> bool:
        return self.world_size > 1

    def _check_parent(self) -> None:
        if self.lifeline is not None:
            if not self.lifeline.poll():
                return
        elif self.parent is None:
            return
        else:                 # a rank's parent is torchrun: ask whether the scheduler is still there
            try:
                os.kill(self.parent, 0)
                return
            except ProcessLookupError:
                pass
        raise SystemExit("hetrain sweep: the scheduler is gone; this trial's worker stops")

    def report(self, value: float, step: int) -> None:
        """An intermediate value at `step`; raises when the pruner stops the trial (let it
        propagate: the sweep records the trial as pruned). In a group trial every rank calls it:
        rank 0's value goes to Optuna and rank 0's decision is every rank's."""
        self._check_parent()
        prune = False
        if self.rank == 0:
            self.trial.report(float(value), int(step))
            prune = self.trial.should_prune()
        if self.agree is not None:
            prune = self.agree(prune)
        self.reports += 1
        if prune:
            raise Pruned(f"pruned at step {step}")

    @contextmanager
    def compute(self, samples: int | None = None):
        """Run a piece of training at the device's speed: through `at_speed` (on a fixed clock,
        `samples`·sample_s/speed). On a GPU, and in a group trial (hetrain's engine runs each rank
        at its device's speed), nothing added."""
        t_wall = time.perf_counter()
        try:
            with self.at_speed(self, samples) if self.at_speed is not None and not self.group else nullcontext():
                yield
        finally:
            self.compute_s += time.perf_counter() - t_wall
            self._check_parent()
