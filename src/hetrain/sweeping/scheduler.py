"""The scheduler: asks Optuna for trials, places them (placement.assign), hands them to the
devices' workers, tells Optuna how each ended; a worker that dies is noticed and restarted.

  * A trial that fits no single device runs over a group of them (groups.py: a hetrain
    data-parallel job, group_job.py); the devices of the group it needs take no other trial once
    free, until the group is whole. A trial that fits no single free device while a group of free
    devices holds it runs on that group rather than wait (the bigger card busy, two small ones
    idle). One that fits no device and no group stops the sweep as bad input: exit 2, its need
    and the largest group's room, the fix (a smaller space, or bigger or more devices).
  * Optuna's own form, objective(trial) (asking.py): its parameters are sampled before it is
    placed once a trial has finished; until then one trial runs at a time on the largest device.
  * A worker process that dies (killed, out of host memory, a crash in native code) fails the trial
    it was running (user attributes `worker_died`: its exit code, and `reason`); the trial counts
    as failed, not retried (the trial itself may be what killed it). The device gets a new worker,
    RESTARTS times; a device whose worker dies once more is left out and the others carry on
    (a queued trial only it could hold fails with the reason). When every device is out: exit 1.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

from dataclasses import dataclass

from ..errors import HetrainError
from ..hardware.units import format_bytes
from .asking import Asker
from .group_job import GroupJob
from .groups import GroupFit, best_group, fits_no_group
from .objective import on_gpu
from .placement import Need, Slot, assign, fits_somewhere
from .worker import worker_main

RESTARTS = 2        # new workers a device gets; its worker dying once more leaves it out
POLL_S = 0.5        # how often a quiet scheduler looks at its workers


# What the fork server imports once, so that each worker (and each worker that replaces a dead one)
# starts without importing it again: Optuna and its SQLite storage, and hetrain's worker. On devices
# that are not CUDA GPUs torch too, with torch._dynamo, which the first optimizer a trial builds
# imports, and hetrain's runtime (the device a trial runs on); never on GPUs, where a worker imports torch only after CUDA_VISIBLE_DEVICES names its GPU
SERVER_MODULES = ("optuna", "optuna.storages", "sqlalchemy.dialects.sqlite", "alembic.command",
                  "alembic.migration", "hetrain.sweeping.worker", "hetrain.sweeping.trial_run")
SERVER_TORCH = ("torch", "torch._dynamo", "hetrain.runtime.engine")


def server_modules(targets) -> tuple[str, ...]:
    return SERVER_MODULES if any(on_gpu(t) for t in targets) else SERVER_MODULES + SERVER_TORCH


def worker_context(targets):
    """The multiprocessing context the workers start from: a fork server, a process of its own with
    no thread and no open storage (forking the scheduler would copy its queues' threads and its
    SQLite connection), preloaded (server_modules). It exits once the scheduler and the workers have."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(server_modules(targets)))
    return ctx


class Workers:
    """One worker process per device, each with its own task queue; one result queue; one lifeline,
    a pipe whose write end only this process holds (never written: the workers see EOF on its read
    end once the scheduler is gone, killed alone included)."""

    def __init__(self, setup):
        self.setup = setup
        self.mp = worker_context(setup.targets)
        self.lifeline, self.held = self.mp.Pipe(duplex=False)
        self.results = self.mp.Queue()
        self.procs: dict = {}
        self.tasks: dict = {}
        for slot in setup.slots:
            self.start(slot.index)

    def start(self, index: int) -> None:
        tasks = self.mp.Queue()
        proc = self.mp.Process(target=worker_main, args=(index, self.setup, tasks, self.results, self.lifeline),
                               daemon=True)
        proc.start()
        self.procs[index], self.tasks[index] = proc, tasks

    def give(self, index: int, task) -> None:
        self.tasks[index].put(task)

    def pid(self, index: int) -> int:
        return self.procs[index].pid

    def dead(self, indices) -> list[tuple[int, int]]:
        """(device index, exit code) of the given devices' workers that are no longer running."""
        return [(i, self.procs[i].exitcode) for i in indices if not self.procs[i].is_alive()]

    def next_result(self, timeout: float):
        try:
            return self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait()
        except queue.Empty:
            return None

    def stop(self, *, now: bool) -> None:
        """Done: each worker told to leave. On an error: killed, so the error shows at once (the
        trials they held stay RUNNING in the study: the next run re-queues them)."""
        for i, proc in self.procs.items():
            if proc.is_alive():
                proc.kill() if now else self.tasks[i].put(None)
        for proc in self.procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


@dataclass
class Run:
    """A trial placed: on one device (members of one) or on a group (its job)."""

    number: int
    trial: object
    need: Need
    placed: float
    members: tuple[int, ...]
    group: GroupFit | None = None
    job: GroupJob | None = None


class Scheduler:
    def __init__(self, setup, module, study, trial_id, result, say, *, workers=Workers, callbacks=(),
                 stopped=lambda: False, storage=None):
        self.setup, self.module, self.study, self.trial_id = setup, module, study, trial_id
        self.result, self.say, self.make_workers = result, say, workers
        self.callbacks, self.stopped = tuple(callbacks or ()), stopped
        fix = None if storage is None else (
            lambda number, params: storage.set_trial_system_attr(trial_id(number), "fixed_params", params))
        self.asker = Asker(setup, module, study, fix)
        self.queued: dict[int, tuple[object, Need]] = {}      # number -> (trial, need): asked, not placed
        self.running: dict[int, Run] = {}                      # lead device -> its run
        self.live = [s.index for s in setup.slots]             # devices with a worker
        self.finished = 0
        self.todo = 0

    def run(self, todo: float, deadline: float | None = None) -> None:
        """Until `todo` trials have finished; past the deadline (study.optimize's timeout) or once
        the study is stopped, no new trial is asked and the ones asked finish, as in Optuna."""
        self.todo = todo
        self.workers = self.make_workers(self.setup)
        asked, ok = 0, False
        try:
            while True:
                if self.stopped() or (deadline is not None and time.perf_counter() >= deadline):
                    self.todo = todo = min(todo, asked)
                if self.finished >= todo:
                    break
                live = [s for s in self.setup.slots if s.index in self.live]
                while asked < todo and len(self.queued) < len(live) and self.asker.may_ask(self.queued, self.running):
                    number, trial, need = self.asker.ask(live)
                    self.queued[number] = (trial, need)
                    asked += 1
                self.place(live)
                if (got := self.workers.next_result(POLL_S)) is not None:
                    self.finish(*got)
                for lead, r in list(self.running.items()):
                    if r.job is not None and (got := r.job.poll()) is not None:
                        self.finish(*got)
                self.check_workers()
            ok = True
        finally:
            for r in self.running.values():
                if r.job is not None:
                    r.job.stop()
            self.workers.stop(now=not ok)

    def busy(self) -> set[int]:
        return {i for r in self.running.values() for i in r.members}

    def place(self, live: list[Slot]) -> None:
        for number, (trial, need) in list(self.queued.items()):
            if fits_somewhere(need, live) is not None and best_group(need, live) is None:
                del self.queued[number]       # only a device left out could hold it
                self.end(None, number, trial, need, "failed", None, f"no device left holds it: {fits_no_group(need, live)}",
                         0.0)
        busy = self.busy()
        free = [s for s in live if s.index not in busy]
        # a trial only a group holds: that group, once its devices are free; until then they wait for it
        for number, (trial, need) in list(self.queued.items()):
            if fits_somewhere(need, live) is None:
                continue
            fit = best_group(need, live)
            if all(s.index not in busy for s in fit.members):
                self.start_group(number, fit)
            free = [s for s in free if s not in fit.members]
            break
        picks = assign([(n, need) for n, (_, need) in self.queued.items()], free, self.setup.slots)
        for number, slot in picks:
            self.start_one(number, slot)
        free = [s for s in free if s not in {slot for _, slot in picks}]
        # a trial no free device holds alone, while free devices hold it together: rather than wait
        for number, (trial, need) in sorted(self.queued.items(), key=lambda kv: -kv[1][1].bytes):
            if len(free) > 1 and fits_somewhere(need, free) is not None and (fit := best_group(need, free)) is not None:
                self.start_group(number, fit)
                free = [s for s in free if s not in fit.members]

    def start_one(self, number: int, slot: Slot) -> None:
        trial, need = self.queued.pop(number)
        trial.set_user_attr("device", slot.label)
        trial.set_user_attr("worker_pid", self.workers.pid(slot.index))
        self.running[slot.index] = Run(number=number, trial=trial, need=need, placed=time.perf_counter(),
                                       members=(slot.index,))
        self.workers.give(slot.index, (self.trial_id(number), number, trial.user_attrs["params_given"]))

    def start_group(self, number: int, fit: GroupFit) -> None:
        trial, need = self.queued.pop(number)
        lead = fit.members[0].index
        job = GroupJob(self.setup, fit, trial_id=self.trial_id(number), number=number,
                       params=trial.user_attrs["params_given"], lead=lead)
        label = f"{fit.label} (group, {fit.sharding})"
        trial.set_user_attr("device", label)
        trial.set_user_attr("group_pid", job.pid())
        trial.set_user_attr("sharding", fit.sharding)
        self.running[lead] = Run(number=number, trial=trial, need=need, placed=time.perf_counter(),
                                 members=tuple(s.index for s in fit.members), group=fit, job=job)
        self.say(f"trial {number} needs {format_bytes(need.bytes)}: a data-parallel job over {fit.label}, "
                 f"{fit.sharding} sharding ({fit.why})")

    def finish(self, index, number, state, value, note, busy, reports, peak=None, stop=False) -> None:
        held = self.running.get(index)
        if held is None or held.number != number:     # a dead worker's last word, its trial already failed
            return
        if stop:                                      # the objective called trial.study.stop()
            self.study.stop()
        self.end(index, number, held.trial, held.need, state, value, note, busy, reports, peak=peak,
                 run=self.running.pop(index))

    def end(self, index, number, trial, need, state, value, note, busy, reports=0, *, peak=None, run=None) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("busy_s", busy)
        if peak is not None:
            trial.set_user_attr("peak_bytes", peak)
            self.asker.measured(number, peak)
        need = self.asker.need_after(number, need, peak)
        group = run.group if run is not None else None
        if index is not None:
            for i in run.members if run is not None else (index,):
                self.result.tally[i].busy_s += busy
            tally = self.result.tally[index] if group is None else self.result.group_tally(group.label)
            tally.busy_s += busy if group is not None else 0.0
            tally.largest_bytes = max(tally.largest_bytes, need.bytes)
            setattr(tally, state, getattr(tally, state) + 1)
        if state == "complete":
            self.study.tell(trial, value)
        else:
            if note and state == "failed":
                trial.set_user_attr("reason", note)
            self.study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
        self.finished += 1
        if self.callbacks:       # study.optimize's callbacks, as Optuna calls them after each trial
            frozen = next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)
            for callback in self.callbacks:
                callback(self.study, frozen)
        label = None if index is None else trial.user_attrs.get("device", self.setup.slots[index].label)
        self.result.ran.append({"number": number, "device": label, "state": state, "value": value,
                                "params": self.asker.params_of(number, trial), "memory_bytes": need.bytes,
                                "busy_s": busy, "note": note, "reports": reports, "peak_bytes": peak,
                                "group": [s.label for s in group.members] if group is not None else None,
                                "sharding": group.sharding if group is not None else None})
        shown = f"value {value:.6g}" if value is not None else note
        self.say(f"trial {number}{f' on {label}' if label else ''}: {state}, {shown} ({busy:.1f} s) "
                 f"[{self.finished}{f'/{self.todo}' if self.todo != float('inf') else ''}]")

    def check_workers(self) -> None:
        for index, code in self.workers.dead(self.live):
            while (got := self.workers.next_result(0)) is not None:   # what it sent before it died
                self.finish(*got)
            tally, label = self.result.tally[index], self.setup.slots[index].label
            tally.deaths += 1
            number = None
            held = self.running.get(index)
            if held is not None and held.job is None:        # a group's job runs on without its members' workers
                self.running.pop(index)
                number = held.number
                held.trial.set_user_attr("worker_died", code)
                self.end(index, number, held.trial, held.need, "failed", None,
                         f"the worker of {label} died (exit code {code})", time.perf_counter() - held.placed, run=held)
            restart = tally.deaths <= RESTARTS
            during = f" during trial {number}" if number is not None else ""
            if restart:
                self.workers.start(index)
                self.say(f"the worker of {label} died (exit code {code}){during}: a new one started")
            else:
                tally.retired = True
                self.live.remove(index)
                self.say(f"the worker of {label} died (exit code {code}){during}, {tally.deaths} times: "
                         "the device is left out of the rest of the sweep")
            self.result.deaths.append({"device": label, "exit_code": code, "trial": number, "restarted": restart})
        if not self.live:
            raise HetrainError(f"every device's worker died {RESTARTS + 1} times (the workers' errors are above)",
                               "fix what kills them, then run the same command again: the sweep resumes")
