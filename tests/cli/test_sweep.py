"""`hetrain sweep` as a user meets it: trials at once on an emulated A100 + 3090 (a controlled clock,
so nothing depends on this host's speed), the wide trials only on the card that holds them, the
median pruner stopping the trials that report far worse, the table, bad input as one line; a sweep
killed outright (scheduler and workers) resumed by the same command; a worker killed alone replaced.

The kills wait on the study's own file (what a trial's state is, whether it has reported), polled
with generous deadlines, never on sleeps tuned to this host's speed."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from clirun import SRC, hetrain, hetrain_here, one_line_error

OBJECTIVE = Path(__file__).parent / "scripts" / "sweep_objective.py"
SPEC = "a100-80g@64MiB,rtx3090@4MiB"


def test_a_sweep_places_by_memory_prunes_and_prints_the_table(tmp_path):
    db, out = tmp_path / "s.db", tmp_path / "s.json"
    r = hetrain("sweep", str(OBJECTIVE), "--emulate", SPEC, "--trials", "8", "--storage", str(db),
                "--emulate-sample-s", "0.002", "--pruner", "median:startup=2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    ran = {t["number"]: t for t in data["trials_run"]}
    assert sorted(ran) == list(range(8))                                   # every trial, once
    for number, t in ran.items():
        if number % 2 == 0:                                                # wide: 6.3 MiB, only the A100 holds it
            assert t["device"].startswith("a100-80g"), t
    assert any(t["device"].startswith("rtx3090") for t in ran.values())    # the small card worked too
    assert ran[4]["state"] == "pruned" and ran[7]["state"] == "pruned"     # reported 100 worse than the rest
    study = optuna.load_study(study_name="sweep_objective", storage=f"sqlite:///{db}")
    states = [t.state.name for t in study.get_trials()]
    assert len(states) == 8 and states.count("PRUNED") == sum(d["pruned"] for d in data["devices"])
    rows = [line for line in r.stdout.splitlines() if "│" in line]
    assert [row.split("│")[0].strip() for row in rows] == ["a100-80g#0 (emulated)", "rtx3090#1 (emulated)"]
    assert "best: trial" in r.stdout
    assert "pruner: median (pruning starts after 2 finished trial(s)" in r.stderr      # the pruner as set
    pruned = sum(t["state"] == "pruned" for t in ran.values())                         # and how trials count
    assert f"{pruned} pruned" in r.stdout and "all count toward --trials" in r.stdout
    # run again on the same storage: the study is complete, nothing more runs (no worker starts, so
    # in this process)
    again = hetrain_here("sweep", str(OBJECTIVE), "--emulate", SPEC, "--trials", "8", "--storage", str(db),
                         "--emulate-sample-s", "0.002")
    assert again.returncode == 0 and "8 trial(s) already finished; 0 to go" in again.stderr, again.stderr


@pytest.mark.parametrize("args, words", [
    (("--storage", "{file}/s.db"), ("is a file, not a directory",)),
    (("--storage", "{tmp}/missing/s.db"), ("does not exist",)),
    (("--trials", "0"), ("--trials 0 must be at least 1",)),
    (("--pruner", "hyperband"), ("--pruner 'hyperband': 'hyperband' is not one of median, none",)),
    (("--pruner", "median:startup=x"), ("startup='x' must be a whole number", "--pruner median:startup=5")),
    (("--pruner", "median:patience=3"), ("'patience=3' is not one of startup=N, warmup=N, interval=N",)),
    (("--pruner", "none:startup=1"), ("none takes no settings",)),
])
def test_bad_input_is_one_line(tmp_path, args, words):
    (tmp_path / "f").write_text("")
    argv = [a.format(tmp=tmp_path, file=tmp_path / "f") for a in args]
    base = {"--trials": "2", "--storage": str(tmp_path / "ok.db")}
    for flag, value in base.items():
        if flag not in argv:
            argv += [flag, value]
    one_line_error(hetrain_here("sweep", str(OBJECTIVE), "--emulate", SPEC, *argv), *words)


def test_an_objective_without_train_says_what_to_define(tmp_path):
    bad = tmp_path / "obj.py"
    bad.write_text("def space(trial):\n    return {}\n")
    one_line_error(hetrain_here("sweep", str(bad), "--emulate", SPEC, "--trials", "1",
                                "--storage", str(tmp_path / "s.db")), "defines no train()", "train(params, ctx)")


def test_a_trial_that_fits_no_device_stops_the_sweep_as_one_line(tmp_path):
    # the wide trials (6.3 MiB) fit no 4 MiB card: trial 0 is one of them
    one_line_error(hetrain_here("sweep", str(OBJECTIVE), "--emulate", "rtx3090@4MiB", "--trials", "2",
                                "--storage", str(tmp_path / "s.db"), "--emulate-sample-s", "0.002"),
                   "trial 0", "fits no device and no group", "the largest group, 1 device(s) (rtx3090#0",
                   "narrow the search space", "bigger or more devices")
    study = optuna.load_study(study_name="sweep_objective", storage=f"sqlite:///{tmp_path / 's.db'}")
    assert study.trials[0].state.name == "FAIL" and study.trials[0].user_attrs["unplaced"] is True


# ---- kills: a sweep started as a user would, in its own session (its own process group) ----

def start_sweep(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "120"}
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "hetrain", "sweep", *args], stdout=out, stderr=err, text=True,
                                env=env, start_new_session=True)


def trials_in(db: Path) -> dict[int, dict]:
    """The study's trials, read straight from its SQLite file (read only, so the poll never takes a
    write lock): number -> {state, reports, attrs}; {} while the file or its tables do not exist."""
    if not db.exists():
        return {}
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        try:
            rows = con.execute("SELECT t.number, t.state, (SELECT COUNT(*) FROM trial_intermediate_values v "
                               "WHERE v.trial_id = t.trial_id) FROM trials t").fetchall()
            attrs = con.execute("SELECT t.number, a.key, a.value_json FROM trial_user_attributes a "
                                "JOIN trials t ON a.trial_id = t.trial_id").fetchall()
        finally:
            con.close()
    except sqlite3.OperationalError:        # not made yet, or being made
        return {}
    out = {number: {"state": state, "reports": reports, "attrs": {}} for number, state, reports in rows}
    for number, key, value in attrs:
        out[number]["attrs"][key] = json.loads(value)
    return out


def wait_for(proc: subprocess.Popen, db: Path, until, what: str, tmp_path: Path, name: str, deadline_s=240):
    """Poll the study until `until(trials)` is true; the sweep ending first, or the deadline, fails."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        trials = trials_in(db)
        if until(trials):
            return trials
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended (exit {proc.returncode}) before {what}: {trials}\n"
                        + (tmp_path / f"{name}.err").read_text()[-3000:])
        time.sleep(0.1)
    pytest.fail(f"no {what} within {deadline_s} s: {trials_in(db)}")


def group_gone(pgid: int, deadline_s: float = 60) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_sweep_killed_outright_is_resumed_by_the_same_command(tmp_path):
    db = tmp_path / "s.db"
    # 6 steps of 32 samples at 15 ms: a trial lasts ~3 s on the A100, ~4.5 s on the 3090; a trial
    # seen running with a report has a step (0.5-0.7 s) or more left when the kill follows the poll
    args = [str(OBJECTIVE), "--emulate", SPEC, "--trials", "6", "--storage", str(db), "--emulate-sample-s", "0.015"]
    proc = start_sweep(tmp_path, "first", *args)
    try:
        wait_for(proc, db, lambda ts: any(t["state"] == "COMPLETE" for t in ts.values()) and any(
            t["state"] == "RUNNING" and t["reports"] >= 1 for t in ts.values()),
            "a complete trial and one running (reported) at once", tmp_path, "first")
        os.killpg(proc.pid, signal.SIGKILL)             # the scheduler and every worker
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert group_gone(proc.pid), "a process of the killed sweep is still alive"
    at_kill = trials_in(db)
    running = sorted(n for n, t in at_kill.items() if t["state"] == "RUNNING")
    done_before = {n: t for n, t in at_kill.items() if t["state"] in ("COMPLETE", "PRUNED", "FAIL")}
    assert running and done_before

    again = hetrain("sweep", *args, "--json", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "in use by another" not in again.stderr           # the kernel freed the dead sweep's flock
    assert f"resumed: {len(running)} trial(s)" in again.stderr, again.stderr
    assert f"{len(running)} interrupted trial(s) resumed" in again.stdout, again.stdout
    study = optuna.load_study(study_name="sweep_objective", storage=f"sqlite:///{db}")
    trials = {t.number: t for t in study.get_trials()}
    interrupted = sorted(n for n, t in trials.items() if t.user_attrs.get("interrupted"))
    assert interrupted == running and all(trials[n].state.name == "FAIL" for n in interrupted)
    counted = [t for t in trials.values() if not t.user_attrs.get("interrupted")]
    assert len(counted) == 6 and all(t.state.name in ("COMPLETE", "PRUNED") for t in counted)
    for n, t in done_before.items():                          # what had finished is left as it was
        assert trials[n].state.name == t["state"]
    for n in interrupted:                                     # each re-run once, with its parameters
        retries = [t for t in counted if t.user_attrs.get("retry_of") == n]
        assert len(retries) == 1, (n, [t.user_attrs for t in counted])
        if trials[n].params:                                  # empty only if killed between ask and space()
            assert retries[0].params == trials[n].params
    lrs = [t.params["lr"] for t in counted]
    assert len(set(lrs)) == len(lrs)                          # no hyperparameters run twice
    ran = json.loads((tmp_path / "again.json").read_text())["trials_run"]
    assert len(ran) == 6 - len(done_before)                   # this run ran only what was missing
    # complete: the same command once more runs nothing (no worker starts, so in this process)
    third = hetrain_here("sweep", *args)
    assert third.returncode == 0 and "6 trial(s) already finished; 0 to go" in third.stderr, third.stderr


def test_a_worker_killed_mid_trial_fails_that_trial_and_a_new_worker_takes_over(tmp_path):
    db, out = tmp_path / "s.db", tmp_path / "s.json"
    # one device, so the trials after the kill can only run on its new worker; ~4 s a trial, so
    # trial 0 has ~3 s of steps left after its first report, when the poll sees it and kills
    args = [str(OBJECTIVE), "--emulate", "a100-80g@64MiB", "--trials", "3", "--storage", str(db),
            "--emulate-sample-s", "0.02", "--pruner", "none", "--json", str(out)]
    proc = start_sweep(tmp_path, "sweep", *args)
    try:
        at = wait_for(proc, db, lambda ts: 0 in ts and ts[0]["state"] == "RUNNING" and ts[0]["reports"] >= 1
                      and "worker_pid" in ts[0]["attrs"], "trial 0 running on its worker", tmp_path, "sweep")
        victim = at[0]["attrs"]["worker_pid"]
        os.kill(victim, signal.SIGKILL)                        # the worker alone, not the scheduler
        assert proc.wait(timeout=240) == 0, (tmp_path / "sweep.err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    stdout, stderr = (tmp_path / "sweep.out").read_text(), (tmp_path / "sweep.err").read_text()
    study = optuna.load_study(study_name="sweep_objective", storage=f"sqlite:///{db}")
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"], stderr[-3000:]
    assert trials[0].user_attrs["worker_died"] == -signal.SIGKILL
    assert "died (exit code -9)" in trials[0].user_attrs["reason"]
    new = {t.user_attrs["worker_pid"] for t in trials[1:]}
    assert victim not in new and len(new) == 1                 # one new worker ran the rest
    assert "the worker of a100-80g#0 (emulated) died (exit code -9) during trial 0: a new one started" in stderr
    data = json.loads(out.read_text())
    assert data["devices"][0]["worker_deaths"] == 1 and data["devices"][0]["failed"] == 1
    assert data["devices"][0]["complete"] == 2 and not data["devices"][0]["left_out"]
    header = next(line for line in stdout.splitlines() if line.startswith("device"))
    row = next(line for line in stdout.splitlines() if line.startswith("a100-80g#0"))
    assert header.split("┃")[-1].strip() == "worker died" and row.split("│")[-1].strip() == "1"
    assert "during trial 0, which failed; a new one took over" in stdout


def test_a_scheduler_killed_alone_leaves_no_worker_training(tmp_path):
    db = tmp_path / "s.db"
    # 6 steps of ~1.3 s (A100) or ~1.9 s (3090): a worker left training would report all 6
    args = [str(OBJECTIVE), "--emulate", SPEC, "--trials", "4", "--storage", str(db), "--emulate-sample-s", "0.04"]
    proc = start_sweep(tmp_path, "sweep", *args)
    try:
        at = wait_for(proc, db, lambda ts: any(t["state"] == "RUNNING" and 1 <= t["reports"] <= 3
                                               and "worker_pid" in t["attrs"] for t in ts.values()),
                      "a trial running on its worker, early", tmp_path, "sweep")
        os.kill(proc.pid, signal.SIGKILL)                      # the scheduler alone
        proc.wait(timeout=60)
        # what the study held once the scheduler was dead: on a busy host the poll above can see
        # a trial a step or more before the kill lands
        at_kill = trials_in(db)
        assert group_gone(proc.pid, deadline_s=120), "workers outlived their scheduler"
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    after = trials_in(db)
    for n, t in at.items():
        if t["state"] == "RUNNING" and t["reports"] >= 1:
            # its worker stopped at the step under way when the scheduler died, not at the trial's end
            assert after[n]["reports"] <= at_kill[n]["reports"] + 1 and after[n]["reports"] < 6, (n, t, at_kill[n],
                                                                                                  after[n])


def test_a_storage_another_sweep_holds_is_one_line(tmp_path):
    import fcntl

    db = tmp_path / "s.db"
    with open(f"{db}.lock", "a") as held:                     # as a running sweep holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        one_line_error(hetrain_here("sweep", str(OBJECTIVE), "--emulate", SPEC, "--trials", "2", "--storage", str(db)),
                       "is in use by another hetrain sweep", "give another --storage")


# ---- Optuna's own objective(trial); trials over a group of devices ----

OPTUNA_OBJECTIVE = Path(__file__).parent / "scripts" / "sweep_optuna_objective.py"
GROUP_OBJECTIVE = Path(__file__).parent / "scripts" / "sweep_group_objective.py"


def placed_after_the_first(study) -> None:
    """The first trial ran alone (nothing started before it finished); every later one was placed
    knowing its parameters: those sampled before it ran are those the objective suggested."""
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    first = trials[0]
    assert first.user_attrs["params_given"] == {} and first.user_attrs["device"].startswith("a100-80g")
    assert all(t.datetime_start >= first.datetime_complete for t in trials[1:])
    for t in trials[1:]:
        assert t.user_attrs["params_given"] == t.params and set(t.params) == {"width", "lr"}, t.user_attrs


def test_optunas_own_objective_runs_as_written_placed_by_memory(tmp_path):
    db, out = tmp_path / "s.db", tmp_path / "s.json"
    r = hetrain("sweep", str(OPTUNA_OBJECTIVE), "--emulate", SPEC, "--trials", "6", "--storage", str(db),
                "--emulate-sample-s", "0.002", "--pruner", "none", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    study = optuna.load_study(study_name="sweep_optuna_objective", storage=f"sqlite:///{db}")
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE"] * 6
    placed_after_the_first(study)
    for t in study.get_trials():
        assert t.user_attrs["ran_on"] == t.user_attrs["device"]           # hetrain.sweep named its device
        if t.number > 0 and t.params["width"] == 512:                     # memory(params): 6.3 MiB, the A100 only
            assert t.user_attrs["device"].startswith("a100-80g"), t.user_attrs
    data = json.loads(out.read_text())
    assert {t["number"]: t["params"] for t in data["trials_run"]} == {t.number: t.params for t in study.get_trials()}


def test_optunas_own_objective_without_memory_is_placed_by_the_first_trials_measured_peak(tmp_path):
    src = OPTUNA_OBJECTIVE.read_text().replace("def memory(params):", "def no_memory(params):")
    obj = tmp_path / "measured.py"
    obj.write_text(src)
    db = tmp_path / "s.db"
    # emulated, the peak is the worker's resident memory growth (torch's first allocations with it):
    # cards of a process's size, so that later trials fit both
    r = hetrain("sweep", str(obj), "--emulate", "a100-80g@2GiB,rtx3090@1GiB", "--trials", "3", "--storage", str(db),
                "--emulate-sample-s", "0.002", "--pruner", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    study = optuna.load_study(study_name="measured", storage=f"sqlite:///{db}")
    placed_after_the_first(study)
    peak = study.trials[0].user_attrs["peak_bytes"]
    assert peak > 0
    for t in study.trials[1:]:       # the need of the later trials: the largest peak measured before them
        before = [u.user_attrs["peak_bytes"] for u in study.trials if u.datetime_complete <= t.datetime_start]
        assert t.user_attrs["memory_bytes"] == max(before), (t.number, t.user_attrs, before)


def test_an_objective_file_with_neither_form_names_both(tmp_path):
    bad = tmp_path / "obj.py"
    bad.write_text("def memory(params):\n    return {}\n")
    one_line_error(hetrain_here("sweep", str(bad), "--emulate", SPEC, "--trials", "1", "--storage", str(tmp_path / "s.db")),
                   "defines neither objective(trial) nor space(trial) and train(params, ctx)", "objective(trial) -> float")


def reference_loss(lr: float) -> float:
    """The group objective's training in this process, no hetrain: the loss of its last step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("group_reference", GROUP_OBJECTIVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x, y = module.data()
    model, opt = module.model_and_opt(lr)
    for step in range(module.STEPS):
        loss = torch_mse(model(x[step * module.BATCH:(step + 1) * module.BATCH]), y[step * module.BATCH:(step + 1) * module.BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def torch_mse(a, b):
    import torch

    return torch.nn.functional.mse_loss(a, b)


def test_a_trial_too_big_for_one_card_runs_as_a_data_parallel_job_over_a_group(tmp_path):
    db, out = tmp_path / "s.db", tmp_path / "s.json"
    r = hetrain("sweep", str(GROUP_OBJECTIVE), "--emulate", "rtx3090@64MiB,rtx3090@64MiB", "--trials", "4",
                "--storage", str(db), "--emulate-sample-s", "0.002", "--pruner", "none", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    ran = {t["number"]: t for t in data["trials_run"]}
    assert sorted(ran) == [0, 1, 2, 3] and all(t["state"] == "complete" for t in ran.values()), ran
    for n, t in ran.items():
        if n % 2 == 0:      # declared 91.6 MiB: more than one card's 57.6 MiB room, sharded over both
            assert t["group"] == ["rtx3090#0 (emulated)", "rtx3090#1 (emulated)"] and t["sharding"] == "fsdp", t
            # rank 0's value, the big-batch math of the job: what one process training alone reaches
            assert t["value"] == pytest.approx(reference_loss(t["params"]["lr"]), rel=1e-4)
        else:
            assert t["group"] is None and t["device"].startswith("rtx3090#"), t
    assert data["groups"] == [{"group": "rtx3090#0 (emulated) + rtx3090#1 (emulated)", "complete": 2, "pruned": 0,
                               "failed": 0, "busy_s": pytest.approx(sum(ran[n]["busy_s"] for n in (0, 2))),
                               "largest_bytes": pytest.approx(ran[0]["memory_bytes"])}]
    row = next(line for line in r.stdout.splitlines() if line.startswith("group "))
    assert row.split("│")[2].strip() == "2"                       # its complete column
    assert "a data-parallel job over rtx3090#0 (emulated) + rtx3090#1 (emulated), fsdp sharding" in r.stderr


def test_a_group_trial_no_group_holds_is_one_line_with_its_need_and_the_largest_groups_room(tmp_path):
    one_line_error(hetrain_here("sweep", str(GROUP_OBJECTIVE), "--emulate", "rtx3090@32MiB,rtx3090@32MiB", "--trials", "2",
                                "--storage", str(tmp_path / "s.db"), "--emulate-sample-s", "0.002"),
                   "trial 0", "fits no device and no group", "needs 91.6 MiB",
                   "the largest group, 2 device(s)", "has room for 57.6 MiB together", "under its best sharding, fsdp")


# ---- a stock Optuna script (its __main__ makes the study); conditional search spaces ----

STOCK = Path(__file__).parent / "scripts" / "sweep_optuna_stock.py"
CONDITIONAL = Path(__file__).parent / "scripts" / "sweep_conditional.py"


def script_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("script: ")]


def test_a_stock_optuna_script_keeps_its_direction_sampler_and_pruner_and_finds_stocks_best(tmp_path):
    stock = subprocess.run([sys.executable, str(STOCK)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert stock.returncode == 0, stock.stderr[-3000:]
    db = tmp_path / "s.db"
    # the command line a user gives a stock script: no --trials, --direction or --pruner
    r = hetrain("sweep", str(STOCK), "--emulate", SPEC, "--storage", str(db), "--emulate-sample-s", "0.002")
    assert r.returncode == 0, r.stderr[-3000:]
    study = optuna.load_study(study_name="sweep_optuna_stock", storage=f"sqlite:///{db}")
    assert study.direction.name == "MAXIMIZE"
    trials = study.get_trials()
    assert len(trials) == 6                                                    # the script's n_trials
    assert sorted(t.params["k"] for t in trials) == list(range(6))             # its GridSampler: each k once
    best = study.best_trial
    assert (best.value, best.params) == (5.0, {"k": 5})                        # stock's choice
    assert best.state.name == "COMPLETE"                                       # the median pruner left it
    # what the script prints after optimize reads the sweep's study: stock's best
    assert script_lines(r.stdout)[-1] == script_lines(stock.stdout)[-1] == "script: best value 5.0 params {'k': 5}"
    first = next(line for line in r.stderr.splitlines() if line.startswith("pruner: "))
    assert "the script's MedianPruner(" in first and "n_startup_trials=2" in first and "direction: maximize" in first


def test_a_stock_scripts_direction_against_the_command_lines_is_one_line(tmp_path):
    one_line_error(hetrain_here("sweep", str(STOCK), "--emulate", SPEC, "--storage", str(tmp_path / "s.db"),
                                "--direction", "minimize"),
                   "--direction minimize, but sweep_optuna_stock.py's create_study says direction='maximize'",
                   "drop --direction")


def test_a_conditional_search_space_loses_no_trial(tmp_path):
    db = tmp_path / "s.db"
    r = hetrain("sweep", str(CONDITIONAL), "--emulate", "a100-80g@64MiB,rtx3090@64MiB", "--trials", "12",
                "--storage", str(db), "--emulate-sample-s", "0.002", "--pruner", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "KeyError" not in r.stderr, r.stderr[-3000:]
    trials = optuna.load_study(study_name="sweep_conditional", storage=f"sqlite:///{db}").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 12, [t.user_attrs.get("reason") for t in trials]
    branch = {"linear": {"linear_alpha"}, "tree": {"tree_depth"}, "fixed": {"fixed_one"},
              "net": {"net_lr", "net_layers"}}
    for t in trials:                                     # each trial's own branch, suggested in its worker
        assert set(t.params) == {"kind"} | branch[t.params["kind"]], t.params
    assert len({t.params["kind"] for t in trials}) > 1   # more than one branch ran: a conditional space


@pytest.mark.parametrize("text", [
    "def fit(trial):\n    return 0.0\n",
    "def fit(trial):\n    return 0.0\n\nif __name__ == '__main__':\n    print(fit(None))\n",
])
def test_a_file_with_no_objective_and_no_main_making_a_study_is_one_line(tmp_path, text):
    bad = tmp_path / "obj.py"
    bad.write_text(text)
    one_line_error(hetrain_here("sweep", str(bad), "--emulate", SPEC, "--trials", "1", "--storage", str(tmp_path / "s.db")),
                   "defines neither objective(trial) nor space(trial) and train(params, ctx)",
                   "has no `if __name__ == \"__main__\":` that creates a study",
                   "study = optuna.create_study(...); study.optimize(objective")
