"""The scheduler: asks Optuna for trials, places them (placement.assign), hands them to the
devices' workers, tells Optuna how each ended; a worker that dies is noticed and restarted.

  * A trial that fits no device of the sweep (the planner's memory model against the largest
    card) stops the sweep as bad input: exit 2, its need and the largest card's room, the fix
    (a smaller space, or bigger devices). A trial over a group of devices is not supported.
  * A worker process that dies (killed, out of host memory, a crash in native code) fails the trial
    it was running (user attributes `worker_died`: its exit code, and `reason`); the trial counts
    as failed, not retried (the trial itself may be what killed it). The device gets a new worker,
    RESTARTS times; a device whose worker dies once more is left out and the others carry on
    (a queued trial only it could hold fails with the reason). When every device is out: exit 1.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

from ..errors import HetrainError, UsageError
from .placement import Need, assign, fits_somewhere, need_of
from .worker import worker_main

RESTARTS = 2        # new workers a device gets; its worker dying once more leaves it out
POLL_S = 0.5        # how often a quiet scheduler looks at its workers


class Workers:
    """One spawned worker process per device, each with its own task queue; one result queue."""

    def __init__(self, setup):
        self.setup = setup
        self.mp = mp.get_context("spawn")
        self.results = self.mp.Queue()
        self.procs: dict = {}
        self.tasks: dict = {}
        for slot in setup.slots:
            self.start(slot.index)

    def start(self, index: int) -> None:
        tasks = self.mp.Queue()
        proc = self.mp.Process(target=worker_main, args=(index, self.setup, tasks, self.results, os.getpid()),
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


class Scheduler:
    def __init__(self, setup, module, study, trial_id, result, say, *, workers=Workers):
        self.setup, self.module, self.study, self.trial_id = setup, module, study, trial_id
        self.result, self.say, self.make_workers = result, say, workers
        self.queued: dict[int, tuple[object, Need]] = {}              # number -> (trial, need): asked, not placed
        self.running: dict[int, tuple[int, object, Need, float]] = {}  # device -> (number, trial, need, placed at)
        self.live = [s.index for s in setup.slots]                     # devices with a worker
        self.finished = 0
        self.todo = 0

    def run(self, todo: int) -> None:
        self.todo = todo
        self.workers = self.make_workers(self.setup)
        asked, ok = 0, False
        try:
            while self.finished < todo:
                live = [s for s in self.setup.slots if s.index in self.live]
                while asked < todo and len(self.queued) < len(live):
                    self.ask()
                    asked += 1
                self.place(live)
                if (got := self.workers.next_result(POLL_S)) is not None:
                    self.finish(*got)
                self.check_workers()
            ok = True
        finally:
            self.workers.stop(now=not ok)

    def ask(self) -> None:
        from optuna.trial import TrialState

        trial = self.study.ask()
        params = self.module.space(trial)
        if not isinstance(params, dict):
            raise UsageError(f"space(trial) returned {type(params).__name__}, not a dict",
                             "return the trial's hyperparameters as a dict")
        need = need_of(self.module.memory(params) if hasattr(self.module, "memory") else None,
                       where=f"memory({params!r})")
        trial.set_user_attr("params_given", params)
        trial.set_user_attr("memory_bytes", need.bytes)
        if (why := fits_somewhere(need, self.setup.slots)) is not None:
            trial.set_user_attr("reason", why)
            trial.set_user_attr("unplaced", True)        # not counted: it never ran
            self.study.tell(trial, state=TrialState.FAIL)
            raise UsageError(f"trial {trial.number} {params!r} fits no device: {why}",
                             "narrow the search space (or memory()'s answer) to what the largest device holds, "
                             "or sweep on bigger devices (a trial over a group of devices is not supported)")
        self.queued[trial.number] = (trial, need)

    def place(self, live) -> None:
        for number, (trial, need) in list(self.queued.items()):
            if (why := fits_somewhere(need, live)) is not None:     # only a device left out could hold it
                del self.queued[number]
                self.end(None, number, trial, need, "failed", None, f"no device left holds it: {why}", 0.0)
        free = [s for s in live if s.index not in self.running]
        for number, slot in assign([(n, need) for n, (_, need) in self.queued.items()], free, self.setup.slots):
            trial, need = self.queued.pop(number)
            trial.set_user_attr("device", slot.label)
            trial.set_user_attr("worker_pid", self.workers.pid(slot.index))
            self.running[slot.index] = (number, trial, need, time.perf_counter())
            self.workers.give(slot.index, (self.trial_id(number), number, trial.user_attrs["params_given"]))

    def finish(self, index, number, state, value, note, busy, reports) -> None:
        held = self.running.get(index)
        if held is None or held[0] != number:      # a dead worker's last word, its trial already failed
            return
        _, trial, need, _ = self.running.pop(index)
        self.end(index, number, trial, need, state, value, note, busy, reports)

    def end(self, index, number, trial, need, state, value, note, busy, reports=0) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("busy_s", busy)
        if index is not None:
            tally = self.result.tally[index]
            tally.busy_s += busy
            tally.largest_bytes = max(tally.largest_bytes, need.bytes)
            setattr(tally, state, getattr(tally, state) + 1)
        if state == "complete":
            self.study.tell(trial, value)
        else:
            if note and state == "failed":
                trial.set_user_attr("reason", note)
            self.study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
        self.finished += 1
        label = self.setup.slots[index].label if index is not None else None
        self.result.ran.append({"number": number, "device": label, "state": state, "value": value,
                                "params": trial.params, "memory_bytes": need.bytes, "busy_s": busy, "note": note,
                                "reports": reports})
        shown = f"value {value:.6g}" if value is not None else note
        self.say(f"trial {number}{f' on {label}' if label else ''}: {state}, {shown} ({busy:.1f} s) "
                 f"[{self.finished}/{self.todo}]")

    def check_workers(self) -> None:
        for index, code in self.workers.dead(self.live):
            while (got := self.workers.next_result(0)) is not None:   # what it sent before it died
                self.finish(*got)
            tally, label = self.result.tally[index], self.setup.slots[index].label
            tally.deaths += 1
            number = None
            if index in self.running:
                number, trial, need, placed = self.running.pop(index)
                trial.set_user_attr("worker_died", code)
                self.end(index, number, trial, need, "failed", None,
                         f"the worker of {label} died (exit code {code})", time.perf_counter() - placed)
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
