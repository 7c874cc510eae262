"""The sweep: an Optuna study in SQLite, a scheduler in this process, one worker process per device.

  * The study lives in Optuna's RDB storage on SQLite, so it outlives a crash: every trial's
    parameters, intermediate values and result are in the file as they happen. A sweep run again
    on the same storage and study continues it: finished trials count toward --trials, and a trial
    a dead sweep left RUNNING (running on a worker, or asked and waiting for a device) is marked
    failed (user attribute `interrupted`, not counted) and its parameters enqueued again (the new
    trial's user attribute `retry_of` names it), so it is retried with the same hyperparameters.
  * One sweep per storage file at a time (an flock beside it, freed by the kernel when the sweep
    dies): a second one would take the first one's running trials for interrupted.
  * Only the scheduler asks and tells (Optuna's ask/tell, scheduler.py); workers only report
    intermediate values (pruning needs them in the storage) through a Trial object of their own on
    the same study (worker.py).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UsageError
from .objective import load_objective
from .placement import Slot
from .study import counted, parts_of, pruner_text, storage_of

DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True, kw_only=True)
class SweepSetup:
    objective: str                 # the objective file's path
    storage: str                   # the SQLite file
    study: str
    trials: int | None
    slots: tuple[Slot, ...]
    targets: tuple                 # per slot: the GPU's CUDA index, or the target of a device that is not a
                                   # CUDA GPU (enter(), torch_device, at_speed(), group_launch(): its maker's)
    pruner: str = "median"         # a pruner spec (study.parse_pruner)
    direction: str = "minimize"
    sample_s: float | None = None  # seconds per sample at speed 1 where the devices keep a fixed clock (benchmarks, tests)
    # a stock Optuna script (main_form.py): the function its __main__ handed to study.optimize,
    # its (sampler, pruner) pickled for every process, and optimize's timeout; trials None: no
    # n_trials, the timeout ends the sweep
    entry: str | None = None
    parts: bytes | None = None
    timeout: float | None = None

    @property
    def url(self) -> str:
        return f"sqlite:///{os.path.abspath(self.storage)}"


@dataclass
class DeviceTally:
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    busy_s: float = 0.0
    largest_bytes: float = 0.0
    deaths: int = 0                 # times this device's worker process died
    retired: bool = False           # died too often: left out of the rest of the sweep


@dataclass
class SweepResult:
    setup: SweepSetup
    wall_s: float
    ran: list[dict] = field(default_factory=list)      # this run's trials, in finishing order
    tally: dict[int, DeviceTally] = field(default_factory=dict)
    finished_before: int = 0                            # counted trials the study already had
    resumed: list[int] = field(default_factory=list)    # trials a stopped sweep left running, re-queued
    deaths: list[dict] = field(default_factory=list)    # {device, exit_code, trial}: workers that died
    best: dict | None = None
    groups: dict[str, DeviceTally] = field(default_factory=dict)   # group trials, by the group's label

    def group_tally(self, label: str) -> DeviceTally:
        return self.groups.setdefault(label, DeviceTally())


def lock_storage(path: str):
    """The flock that keeps one sweep per storage file; the open file holds it."""
    handle = open(f"{path}.lock", "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UsageError(f"--storage {path!r} is in use by another hetrain sweep",
                         "wait for it to finish, or give another --storage") from None
    return handle


def open_study(setup: SweepSetup, say: Callable[[str], None]):
    """The study, created or continued, and the trials a dead sweep left running, re-queued."""
    import optuna
    from optuna.trial import TrialState

    storage = storage_of(setup.url)
    sampler, pruner = parts_of(setup)
    study = optuna.create_study(storage=storage, study_name=setup.study, load_if_exists=True,
                                direction=setup.direction, sampler=sampler, pruner=pruner)
    if study.direction.name.lower() != setup.direction:
        raise UsageError(f"study {setup.study!r} in {setup.storage!r} was made to {study.direction.name.lower()}, "
                         f"not {setup.direction}", f"pass --direction {study.direction.name.lower()}, or a new --study")
    study_id = storage.get_study_id_from_name(setup.study)
    trials = study.get_trials(deepcopy=False)
    # a sweep killed between the enqueue and the tell below left the retry queued already
    retried = {t.user_attrs.get("retry_of") for t in trials}
    resumed = []
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        if t.number not in retried:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        study.tell(t.number, state=TrialState.FAIL)
        resumed.append(t.number)
    if resumed:
        say(f"resumed: {len(resumed)} trial(s) a stopped sweep left running ({', '.join(map(str, resumed))}) "
            "marked failed (user attribute 'interrupted') and their parameters queued again")
    return study, storage, study_id, resumed


class Sweep:
    """A sweep's study, held: the storage locked, the study made or continued. `run` runs trials on
    it (once for a file in the objective forms; once per study.optimize of a stock script)."""

    def __init__(self, setup: SweepSetup, say: Callable[[str], None]):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.say, self.stopped = say, False
        self.lock = lock_storage(setup.storage)
        try:
            self.study, self.storage, self.study_id, self.resumed = open_study(setup, say)
        except BaseException:
            self.lock.close()
            raise
        # Study.stop, as the script's callbacks and GridSampler (its grid used up) call it: no new trial
        self.study.stop = self.stop

    def stop(self) -> None:
        self.stopped = True

    def finished(self) -> int:
        return sum(counted(t) for t in self.study.get_trials(deepcopy=False))

    def run(self, setup: SweepSetup, module, *, callbacks=()) -> SweepResult:
        """Trials until the study has setup.trials finished, or setup.timeout passed, or stop()."""
        from optuna.trial import TrialState

        from .scheduler import Scheduler

        study, storage, study_id = self.study, self.storage, self.study_id
        before = self.finished()
        result = SweepResult(setup=setup, wall_s=0.0, finished_before=before, resumed=self.resumed,
                             tally={s.index: DeviceTally() for s in setup.slots})
        self.resumed, self.stopped = [], False
        todo = float("inf") if setup.trials is None else max(0, setup.trials - before)
        goal = (f"until the timeout, {setup.timeout:g} s" if setup.trials is None
                else f"toward {setup.trials} trials (the script's n_trials or --trials)" if setup.entry
                else f"toward --trials {setup.trials}")
        if setup.trials is not None and setup.timeout is not None:
            goal += f", none started after the timeout, {setup.timeout:g} s"
        self.say(f"pruner: {pruner_text(setup)}; direction: {setup.direction}; complete, pruned and failed "
                 f"trials all count {goal}")
        if before and setup.trials is not None:
            self.say(f"study {setup.study!r}: {before} trial(s) already finished; {todo} to go")
        start = time.perf_counter()
        if todo:
            # Optuna's Trial keeps its storage id privately: the worker's Trial is built from the id
            # the storage gives for the trial's number
            trial_id = lambda number: storage.get_trial_id_from_study_id_trial_number(study_id, number)  # noqa: E731
            deadline = None if setup.timeout is None else start + setup.timeout
            Scheduler(setup, module, study, trial_id, result, self.say, callbacks=callbacks,
                      stopped=lambda: self.stopped, storage=storage).run(todo, deadline=deadline)
        result.wall_s = time.perf_counter() - start
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            best = study.best_trial
            result.best = {"number": best.number, "value": best.value, "params": best.params,
                           "device": best.user_attrs.get("device")}
        return result

    def close(self) -> None:
        self.lock.close()


def run_sweep(setup: SweepSetup, *, say: Callable[[str], None]) -> SweepResult:
    """The whole sweep of a file in the objective forms; `say` gets a line per event (a trial
    placed, finished, re-queued)."""
    module = load_objective(setup.objective)
    sweep = Sweep(setup, say)
    try:
        return sweep.run(setup, module)
    finally:
        sweep.close()
