"""`hetrain sweep` as a user meets it: trials at once on an emulated A100 + 3090 (a controlled clock,
so nothing depends on this host's speed), the wide trials only on the card that holds them, the
median pruner stopping the trials that report far worse, the table, and bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from clirun import hetrain, hetrain_here, one_line_error

OBJECTIVE = Path(__file__).parent / "scripts" / "sweep_objective.py"
SPEC = "a100-80g@64MiB,rtx3090@4MiB"


def test_a_sweep_places_by_memory_prunes_and_prints_the_table(tmp_path):
    db, out = tmp_path / "s.db", tmp_path / "s.json"
    r = hetrain("sweep", str(OBJECTIVE), "--emulate", SPEC, "--trials", "8", "--storage", str(db),
                "--emulate-sample-s", "0.002", "--json", str(out))
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
    # run again on the same storage: the study is complete, nothing more runs
    again = hetrain("sweep", str(OBJECTIVE), "--emulate", SPEC, "--trials", "8", "--storage", str(db),
                    "--emulate-sample-s", "0.002")
    assert again.returncode == 0 and "8 trial(s) already finished; 0 to go" in again.stderr, again.stderr


@pytest.mark.parametrize("args, words", [
    (("--storage", "{file}/s.db"), ("is a file, not a directory",)),
    (("--storage", "{tmp}/missing/s.db"), ("does not exist",)),
    (("--trials", "0"), ("--trials 0 must be at least 1",)),
    (("--pruner", "hyperband"), ("--pruner 'hyperband' is not one of median, none",)),
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
