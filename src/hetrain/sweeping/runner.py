"""The sweep: an Optuna study in SQLite, a scheduler in this process, one worker process per device.

  * The study lives in Optuna's RDB storage on SQLite, so it outlives a crash: every trial's
    parameters, intermediate values and result are in the file as they happen. A sweep run again
    on the same storage and study continues it: finished trials count toward --trials, and a trial
    a dead sweep left RUNNING is marked failed (user attribute `interrupted`, not counted) and its
    parameters enqueued again, so it is retried with the same hyperparameters.
  * One sweep per storage file at a time (an flock beside it, freed by the kernel when the sweep
    dies): a second one would take the first one's running trials for interrupted.
  * Only the scheduler asks and tells (Optuna's ask/tell); workers only report intermediate values
    (pruning needs them in the storage) through a Trial object of their own on the same study.
  * Workers are spawned, not forked: each imports torch itself, sees only its own GPU
    (CUDA_VISIBLE_DEVICES set before torch is imported) or, emulated, runs one thread. A worker
    whose parent died (SIGKILL) sees its parent change and leaves.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UsageError
from .objective import load_objective
from .placement import Need, Slot, assign, fits_somewhere, need_of

PRUNERS = ("median", "none")
DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True, kw_only=True)
class SweepSetup:
    objective: str                 # the objective file's path
    storage: str                   # the SQLite file
    study: str
    trials: int
    slots: tuple[Slot, ...]
    targets: tuple[str, ...]       # per slot: "emulated" or the GPU's CUDA index
    pruner: str = "median"
    direction: str = "minimize"
    sample_s: float | None = None  # the emulated devices' controlled clock (benchmarks, tests)

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


@dataclass
class SweepResult:
    setup: SweepSetup
    wall_s: float
    ran: list[dict] = field(default_factory=list)      # this run's trials, in finishing order
    tally: dict[int, DeviceTally] = field(default_factory=dict)
    unplaced: int = 0                                   # trials that fit no device (failed, this run)
    finished_before: int = 0                            # counted trials the study already had
    best: dict | None = None


def _storage(url: str):
    import optuna

    # several processes write the file: wait for SQLite's lock instead of failing at once
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})


def _pruner(name: str):
    import optuna

    # 2 finished trials before any is pruned: a median of one trial is that trial
    return optuna.pruners.MedianPruner(n_startup_trials=2) if name == "median" else optuna.pruners.NopPruner()


def _counted(t) -> bool:
    from optuna.trial import TrialState

    return t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
        t.state == TrialState.FAIL and not t.user_attrs.get("interrupted"))


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
    """The study, created or continued; what a dead sweep left running is re-queued."""
    import optuna
    from optuna.trial import TrialState

    storage = _storage(setup.url)
    study = optuna.create_study(storage=storage, study_name=setup.study, load_if_exists=True,
                                direction=setup.direction, pruner=_pruner(setup.pruner))
    if study.direction.name.lower() != setup.direction:
        raise UsageError(f"study {setup.study!r} in {setup.storage!r} was made to {study.direction.name.lower()}, "
                         f"not {setup.direction}", f"pass --direction {study.direction.name.lower()}, or a new --study")
    study_id = storage.get_study_id_from_name(setup.study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        study.tell(t.number, state=TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
        say(f"trial {t.number} was left running by a sweep that stopped: marked failed, its parameters queued again")
    return study, storage, study_id


def worker_main(index: int, setup: SweepSetup, tasks, results, parent: int) -> None:
    """One device's worker: trials in, outcomes out, until told to stop or its parent is gone."""
    import logging

    slot, target = setup.slots[index], setup.targets[index]
    if target != "emulated":
        os.environ["CUDA_VISIBLE_DEVICES"] = target       # before torch: this GPU alone
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    emulated = target == "emulated"
    if emulated:
        torch.set_num_threads(1)        # one emulated device = one CPU thread, as the job's ranks
    module = load_objective(setup.objective)
    study = optuna.load_study(study_name=setup.study, storage=_storage(setup.url), pruner=_pruner(setup.pruner))
    from .objective import Pruned, TrialContext

    while os.getppid() == parent:
        try:
            task = tasks.get(timeout=0.5)
        except queue.Empty:
            continue
        if task is None:
            return
        trial_id, number, params = task
        ctx = TrialContext(number=number, params=params, device="cpu" if emulated else "cuda:0", label=slot.label,
                           speed=slot.speed, sample_s=setup.sample_s, emulated=emulated,
                           trial=optuna.trial.Trial(study, trial_id))
        t0 = time.perf_counter()
        try:
            value = float(module.train(params, ctx))
            outcome = ("complete", value, None)
        except (Pruned, optuna.TrialPruned) as e:
            outcome = ("pruned", None, str(e) or "pruned")
        except Exception as e:   # noqa: BLE001 — the trial failed; the sweep goes on
            outcome = ("failed", None, f"{type(e).__name__}: {e}".splitlines()[0][:300])
            traceback.print_exc()
        results.put((index, number, *outcome, time.perf_counter() - t0, ctx.reports))


def run_sweep(setup: SweepSetup, *, say: Callable[[str], None]) -> SweepResult:
    """The whole sweep; `say` gets a line per event (a trial placed, finished, re-queued)."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    module = load_objective(setup.objective)
    lock = lock_storage(setup.storage)
    try:
        study, storage, study_id = open_study(setup, say)
        before = sum(_counted(t) for t in study.get_trials(deepcopy=False))
        result = SweepResult(setup=setup, wall_s=0.0, finished_before=before,
                             tally={s.index: DeviceTally() for s in setup.slots})
        todo = max(0, setup.trials - before)
        if before:
            say(f"study {setup.study!r}: {before} trial(s) already finished; {todo} to go")
        start = time.perf_counter()
        if todo:
            # Optuna's Trial keeps its storage id privately: the worker's Trial is built from the id
            # the storage gives for the trial's number
            trial_id = lambda number: storage.get_trial_id_from_study_id_trial_number(study_id, number)  # noqa: E731
            _schedule(setup, module, study, trial_id, todo, result, say)
        result.wall_s = time.perf_counter() - start
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        if done:
            best = study.best_trial
            result.best = {"number": best.number, "value": best.value, "params": best.params,
                           "device": best.user_attrs.get("device")}
        return result
    finally:
        lock.close()


def _schedule(setup, module, study, trial_id, todo, result, say) -> None:
    from optuna.trial import TrialState

    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue() for _ in setup.slots]
    results = ctx.Queue()
    workers = [ctx.Process(target=worker_main, args=(i, setup, tasks[i], results, os.getpid()), daemon=True)
               for i in range(len(setup.slots))]
    for w in workers:
        w.start()
    queued: dict[int, tuple[object, Need]] = {}       # trial number -> (trial, need), asked, not yet placed
    running: dict[int, tuple[int, object, Need]] = {}  # slot index -> (number, trial, need)
    asked = finished = 0
    try:
        while finished < todo:
            free = [s for s in setup.slots if s.index not in running]
            while asked < todo and len(queued) < len(setup.slots):
                trial = study.ask()
                asked += 1
                params = module.space(trial)
                if not isinstance(params, dict):
                    raise UsageError(f"space(trial) returned {type(params).__name__}, not a dict",
                                     "return the trial's hyperparameters as a dict")
                need = need_of(module.memory(params) if hasattr(module, "memory") else None,
                               where=f"memory({params!r})")
                trial.set_user_attr("params_given", params)
                trial.set_user_attr("memory_bytes", need.bytes)
                if (why := fits_somewhere(need, setup.slots)) is not None:
                    trial.set_user_attr("reason", why)
                    study.tell(trial, state=TrialState.FAIL)
                    finished += 1
                    result.unplaced += 1
                    result.ran.append({"number": trial.number, "device": None, "state": "failed", "value": None,
                                       "params": params, "memory_bytes": need.bytes, "busy_s": 0.0, "note": why})
                    say(f"trial {trial.number}: fits no device: {why} [{finished}/{todo}]")
                    continue
                queued[trial.number] = (trial, need)
            for number, slot in assign([(n, need) for n, (_, need) in queued.items()], free, setup.slots):
                trial, need = queued.pop(number)
                trial.set_user_attr("device", slot.label)
                running[slot.index] = (number, trial, need)
                tasks[slot.index].put((trial_id(number), number, trial.user_attrs["params_given"]))
            if finished >= todo:
                break
            try:
                index, number, state, value, note, busy, reports = results.get(timeout=1.0)
            except queue.Empty:
                for i, w in enumerate(workers):
                    if not w.is_alive() and i in running:
                        raise RuntimeError(f"the worker of {setup.slots[i].label} died (exit code {w.exitcode})")
                continue
            _, trial, need = running.pop(index)
            tally = result.tally[index]
            tally.busy_s += busy
            tally.largest_bytes = max(tally.largest_bytes, need.bytes)
            trial.set_user_attr("busy_s", busy)
            if state == "complete":
                study.tell(trial, value)
                tally.complete += 1
            elif state == "pruned":
                study.tell(trial, state=TrialState.PRUNED)
                tally.pruned += 1
            else:
                trial.set_user_attr("reason", note)
                study.tell(trial, state=TrialState.FAIL)
                tally.failed += 1
            finished += 1
            label = setup.slots[index].label
            result.ran.append({"number": number, "device": label, "state": state, "value": value,
                               "params": trial.params, "memory_bytes": need.bytes, "busy_s": busy, "note": note,
                               "reports": reports})
            shown = f"value {value:.6g}" if value is not None else note
            say(f"trial {number} on {label}: {state}, {shown} ({busy:.1f} s) [{finished}/{todo}]")
    finally:
        for i, w in enumerate(workers):
            if w.is_alive():
                tasks[i].put(None)
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
