"""A worker's trials on the sweep's SQLite study, as the scheduler and a worker process each hold it:
a worker's suggestion outside what the scheduler sampled (a conditional branch) is stored, on every
trial the worker runs, and the scheduler's presampled values reach the worker as Optuna's fixed
parameters, recorded only where the objective suggests them."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from hetrain.sweeping.asking import presample
from hetrain.sweeping.study import storage_of
from hetrain.sweeping.trial_run import trial_of


def scheduler_and_url(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(storage=storage_of(url), study_name="s")
    return study, url


def test_a_worker_suggests_beyond_the_presampled_space_on_every_trial(tmp_path):
    scheduler, url = scheduler_and_url(tmp_path)
    worker_storage = storage_of(url)          # one per worker process, kept across its trials
    for n in range(4):
        asked = scheduler.ask()
        trial_id = worker_storage.get_trial_id_from_study_id_trial_number(
            worker_storage.get_study_id_from_name("s"), asked.number)
        trial, _ = trial_of("s", worker_storage, trial_id, None, optuna.pruners.NopPruner())
        kind = trial.suggest_categorical("kind", ["a", "b"])
        trial.suggest_float(f"{kind}_x", 0, 1)               # a branch's own parameter
        trial.suggest_int("one", 1, 1)                       # single-valued: no sampler call before the store
        scheduler.tell(asked, 1.0)
    trials = scheduler.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert all(set(t.params) == {"kind", f"{t.params['kind']}_x", "one"} for t in trials)


def test_presampled_values_are_fixed_params_and_an_unused_branch_is_not_recorded(tmp_path):
    scheduler, url = scheduler_and_url(tmp_path)
    first = scheduler.ask()
    first.suggest_categorical("kind", ["a", "b"])
    first.suggest_float("a_x", 0, 1)
    scheduler.tell(first, 1.0)
    space = {"kind": optuna.distributions.CategoricalDistribution(["a", "b"]),
             "a_x": optuna.distributions.FloatDistribution(0, 1)}
    storage = storage_of(url)
    study_id = storage.get_study_id_from_name("s")
    asked = scheduler.ask()
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, asked.number)
    given = presample(scheduler, asked, space, lambda p: storage.set_trial_system_attr(trial_id, "fixed_params", p))
    assert set(given) == {"kind", "a_x"} and 0 <= given["a_x"] <= 1
    trial, _ = trial_of("s", storage, trial_id, None, optuna.pruners.NopPruner())
    assert trial.suggest_categorical("kind", ["a", "b"]) == given["kind"]      # the value it was placed with
    trial.suggest_float("b_y", 0, 1)                                           # the objective's other branch
    scheduler.tell(asked, 2.0)
    assert set(scheduler.get_trials()[1].params) == {"kind", "b_y"}           # a_x, never suggested, left out


def test_a_trial_stops_at_its_next_compute_once_the_lifeline_closes():
    import multiprocessing

    import pytest

    from hetrain.sweeping.objective import TrialContext

    lifeline, held = multiprocessing.Pipe(duplex=False)
    ctx = TrialContext(number=0, params={}, device="cpu", label="d", lifeline=lifeline)
    with ctx.compute():
        pass                                  # the scheduler holds its end: the trial goes on
    held.close()                              # as the kernel closes it when the scheduler dies
    with pytest.raises(SystemExit, match="the scheduler is gone"):
        with ctx.compute():
            pass
