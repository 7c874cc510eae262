"""Optuna's objective(trial) over a conditional search space: a categorical choice, then different
suggestions per branch (a float, an int, a single-valued int, a log float), so most trials suggest
parameters the scheduler did not sample before placing them. No trial may be lost to it."""

BRANCHES = ("linear", "tree", "fixed", "net")


def objective(trial):
    kind = trial.suggest_categorical("kind", list(BRANCHES))
    if kind == "linear":
        x = trial.suggest_float("linear_alpha", 0.0, 1.0)
    elif kind == "tree":
        x = trial.suggest_int("tree_depth", 1, 8) / 8
    elif kind == "fixed":
        x = trial.suggest_int("fixed_one", 1, 1)          # a single value: Optuna samples nothing for it
    else:
        x = trial.suggest_float("net_lr", 1e-4, 1e-1, log=True) * trial.suggest_int("net_layers", 1, 3)
    trial.report(x, 0)
    return x
