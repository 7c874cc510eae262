"""The scheduler's bookkeeping when workers die, on a real (in-memory) Optuna study and stand-in
workers, so the restart policy is checked exactly: a dead worker's trial fails with its exit code,
the device gets RESTARTS new workers and is then left out, the others carry on, and a queued trial
only the left-out device could hold fails with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import optuna
import pytest

from hetrain.errors import HetrainError
from hetrain.sweeping.placement import Slot
from hetrain.sweeping.runner import DeviceTally, SweepResult, SweepSetup
from hetrain.sweeping.scheduler import RESTARTS, Scheduler

MiB = 2**20
BIG = Slot(index=0, label="a100", memory_bytes=80 * MiB, speed=1.0)
SMALL = Slot(index=1, label="3090", memory_bytes=24 * MiB, speed=0.67)


class StandIn:
    """Workers: those of `dying` die (exit code -9) with each trial handed to them; the others
    complete it at once with the value of x."""

    def __init__(self, dying):
        self.dying = set(dying)
        self.results, self.alive, self.pids, self.starts = [], {}, {}, {}

    def __call__(self, setup):
        for slot in setup.slots:
            self.start(slot.index)
        return self

    def start(self, index):
        self.starts[index] = self.starts.get(index, 0) + 1
        self.alive[index], self.pids[index] = True, 1000 * index + self.starts[index]

    def give(self, index, task):
        _, number, params = task
        if index in self.dying:
            self.alive[index] = False
        else:
            self.results.append((index, number, "complete", params["x"], None, 0.01, 1))

    def pid(self, index):
        return self.pids[index]

    def dead(self, indices):
        return [(i, -9) for i in indices if not self.alive[i]]

    def next_result(self, timeout):
        return self.results.pop(0) if self.results else None

    def stop(self, *, now):
        self.stopped_now = now


def sweep(trials, dying, need_mib):
    setup = SweepSetup(objective="-", storage="-", study="s", trials=trials, slots=(BIG, SMALL),
                       targets=("emulated", "emulated"))
    module = SimpleNamespace(space=lambda t: {"x": t.suggest_float("x", 0, 1), "n": t.number},
                             memory=lambda p: {"bytes": need_mib(p["n"]) * MiB})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    result = SweepResult(setup=setup, wall_s=1.0, tally={0: DeviceTally(), 1: DeviceTally()})
    workers, lines = StandIn(dying), []
    Scheduler(setup, module, study, lambda n: n, result, lines.append, workers=workers).run(trials)
    return study, result, workers, lines


def test_a_device_whose_worker_keeps_dying_is_left_out_and_the_other_carries_on():
    # even trials need 50 MiB (the A100 alone holds them), odd ones 1 MiB; the A100's worker dies each time
    study, result, workers, lines = sweep(8, dying={0}, need_mib=lambda n: 50 if n % 2 == 0 else 1)
    states = {t.number: t for t in study.trials}
    died = sorted(n for n, t in states.items() if "worker_died" in t.user_attrs)
    assert died == [0, 2, 4] and all(states[n].user_attrs["worker_died"] == -9 for n in died)
    assert all("a100 died (exit code -9)" in states[n].user_attrs["reason"] for n in died)
    assert workers.starts == {0: 1 + RESTARTS, 1: 1}                  # two new workers, then no more
    assert result.tally[0].deaths == 3 and result.tally[0].retired and not result.tally[1].retired
    # trial 6 only the left-out A100 could hold: failed with why, not waiting forever
    assert states[6].state.name == "FAIL" and "no device left holds it" in states[6].user_attrs["reason"]
    assert sorted(n for n, t in states.items() if t.state.name == "COMPLETE") == [1, 3, 5, 7]
    assert {t.user_attrs["device"] for n, t in states.items() if n % 2} == {"3090"}
    assert [d["restarted"] for d in result.deaths] == [True, True, False]
    assert any("left out of the rest of the sweep" in line for line in lines)
    assert workers.stopped_now is False                               # a sweep that finished


def test_every_worker_dying_for_good_stops_the_sweep_with_the_fix():
    with pytest.raises(HetrainError, match="every device's worker died 3 times") as e:
        sweep(20, dying={0, 1}, need_mib=lambda n: 1)
    assert "run the same command again" in e.value.fix


def test_the_fork_server_preloads_importable_modules_and_no_torch_on_gpus():
    import importlib.util

    from hetrain.emulation.trials import TARGET
    from hetrain.sweeping.scheduler import server_modules

    emulated, gpus = server_modules((TARGET, TARGET)), server_modules(("0", "1"))
    # the server skips a module it cannot import without a word: a misspelt one would only cost time
    assert all(importlib.util.find_spec(name) is not None for name in emulated + gpus)
    assert {"torch", "torch._dynamo", "optuna"} <= set(emulated)
    # a GPU worker imports torch only after CUDA_VISIBLE_DEVICES names its GPU: none of the GPU
    # server's modules imports it (checked in a fresh interpreter, as the server is one)
    assert "optuna" in gpus
    code = f"import sys\nfor m in {list(gpus)!r}:\n    __import__(m)\nprint('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip() == "False"
