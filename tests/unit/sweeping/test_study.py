"""The pruner spec: Optuna's MedianPruner defaults unless set, every setting reaching the pruner,
a bad spec as one UsageError naming the fix."""

from __future__ import annotations

import optuna
import pytest

from hetrain.errors import UsageError
from hetrain.sweeping.study import parse_pruner


def test_median_is_optunas_median_pruner_with_optunas_defaults():
    spec = parse_pruner("median")
    stock = optuna.pruners.MedianPruner()
    made = spec.make()
    assert isinstance(made, optuna.pruners.MedianPruner)
    # the stock pruner's defaults, read through its signature (its settings are private attributes)
    import inspect

    defaults = {k: v.default for k, v in inspect.signature(type(stock)).parameters.items()}
    assert (spec.startup, spec.warmup, spec.interval) == (defaults["n_startup_trials"], defaults["n_warmup_steps"],
                                                          defaults["interval_steps"])
    assert "after 5 finished trial(s)" in spec.describe()


def test_each_setting_reaches_the_pruner_and_none_is_no_pruning():
    spec = parse_pruner("median:startup=2,warmup=3,interval=4")
    assert (spec.startup, spec.warmup, spec.interval) == (2, 3, 4)
    assert isinstance(parse_pruner("none").make(), optuna.pruners.NopPruner)
    # startup=2 in a study: the third trial, far worse at step 0, is pruned; with startup=3 it is not
    for startup, pruned in ((2, True), (3, False)):
        study = optuna.create_study(pruner=parse_pruner(f"median:startup={startup}").make())
        for value in (1.0, 1.1):
            t = study.ask()
            t.report(value, 0)
            study.tell(t, value)
        t = study.ask()
        t.report(100.0, 0)
        assert bool(t.should_prune()) is pruned


@pytest.mark.parametrize("spec, words", [
    ("hyperband", "'hyperband' is not one of median, none"), ("median:startup=-1", "must be a whole number"),
    ("median:startup", "'startup' is not one of"), ("median:interval=0", "at least 1"),
    ("none:startup=2", "none takes no settings"), ("median:", "no settings after the colon"),
])
def test_a_bad_spec_is_one_usage_error(spec, words):
    with pytest.raises(UsageError, match=words) as e:
        parse_pruner(spec)
    assert "--pruner median" in e.value.fix or "--pruner none" in e.value.fix
