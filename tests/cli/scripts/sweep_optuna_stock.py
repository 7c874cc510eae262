"""A stock Optuna script, written as Optuna's examples are: objective(trial) at the file's top, the
study made and optimized under __main__ with its own direction (maximize), sampler and pruner, and
the best trial printed after optimize. `python sweep_optuna_stock.py` is stock Optuna; `hetrain
sweep sweep_optuna_stock.py` must reach the same best trial.

The GridSampler makes the choice comparable: its first six trials take the six values of k, one each,
in any order of running, so stock and the sweep try the same values; the best is k = 5 when
maximizing (k = 0 if the direction were lost). The MedianPruner, from its second finished trial,
prunes a trial reporting below the median when maximizing, so a sweep that minimized would prune the
high k."""

import optuna
from optuna.trial import TrialState


def objective(trial):
    k = trial.suggest_int("k", 0, 5)
    for step in range(3):
        trial.report(float(k), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return float(k)


if __name__ == "__main__":
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.GridSampler({"k": list(range(6))}),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    study.optimize(objective, n_trials=6)
    complete = study.get_trials(deepcopy=False, states=[TrialState.COMPLETE])
    pruned = study.get_trials(deepcopy=False, states=[TrialState.PRUNED])
    print(f"script: {len(study.trials)} trials, {len(complete)} complete, {len(pruned)} pruned")
    print(f"script: best value {study.best_trial.value} params {study.best_trial.params}")
