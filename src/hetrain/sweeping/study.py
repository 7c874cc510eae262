"""The study's pieces every process of a sweep shares: the storage, the pruner and what counts.

The pruner is a spec, `--pruner median[:startup=N,warmup=S,interval=K]` or `none`. `median` is
Optuna's MedianPruner with Optuna's own defaults: no trial is pruned before `startup` (5) trials
have finished, nor before step `warmup` (0) of its own; it is checked every `interval` (1) steps.
A trial the pruner stops counts toward --trials like a complete one (it used its device), as does
a failed one; an interrupted trial (a sweep that was killed) and one that fit nowhere do not.

A stock Optuna script (its `__main__` makes the study) gives its own sampler and pruner instead:
they travel to every process of the sweep pickled (SweepSetup.parts), so the workers' suggestions
and pruning decisions are the script's, not the defaults.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from ..errors import UsageError

PRUNER_KINDS = ("median", "none")
MEDIAN_KEYS = {"startup": "n_startup_trials", "warmup": "n_warmup_steps", "interval": "interval_steps"}
MEDIAN_DEFAULTS = {"startup": 5, "warmup": 0, "interval": 1}     # optuna.pruners.MedianPruner's own


@dataclass(frozen=True, kw_only=True)
class PrunerSpec:
    kind: str
    startup: int = MEDIAN_DEFAULTS["startup"]
    warmup: int = MEDIAN_DEFAULTS["warmup"]
    interval: int = MEDIAN_DEFAULTS["interval"]

    def describe(self) -> str:
        if self.kind == "none":
            return "none"
        return (f"median (pruning starts after {self.startup} finished trial(s) and at step {self.warmup} of a "
                f"trial, checked every {self.interval} step(s))")

    def make(self):
        import optuna

        if self.kind == "none":
            return optuna.pruners.NopPruner()
        return optuna.pruners.MedianPruner(n_startup_trials=self.startup, n_warmup_steps=self.warmup,
                                           interval_steps=self.interval)


def parse_pruner(spec: str) -> PrunerSpec:
    """`median`, `median:startup=5,warmup=0,interval=1` (any of them) or `none`; a bad spec is one
    UsageError naming the fix."""
    fix = "use --pruner median, --pruner median:startup=5,warmup=0,interval=1 or --pruner none"
    kind, colon, rest = str(spec).strip().partition(":")
    if kind not in PRUNER_KINDS:
        raise UsageError(f"--pruner {spec!r}: {kind!r} is not one of {', '.join(PRUNER_KINDS)}", fix)
    if kind == "none":
        if colon:
            raise UsageError(f"--pruner {spec!r}: none takes no settings", "use --pruner none")
        return PrunerSpec(kind="none")
    if colon and not rest.strip(", "):
        raise UsageError(f"--pruner {spec!r} gives no settings after the colon", fix)
    values = dict(MEDIAN_DEFAULTS)
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if key not in MEDIAN_KEYS or not eq:
            raise UsageError(f"--pruner {spec!r}: {part!r} is not one of {', '.join(k + '=N' for k in MEDIAN_KEYS)}",
                             fix)
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number < (1 if key == "interval" else 0):
            raise UsageError(f"--pruner {spec!r}: {key}={value!r} must be a whole number of at least "
                             f"{1 if key == 'interval' else 0}", fix)
        values[key] = number
    return PrunerSpec(kind="median", **values)


def pruner_of(spec: str):
    return parse_pruner(spec).make()


def parts_of(setup) -> tuple:
    """(sampler, pruner) of the sweep's study: the script's own, else Optuna's default sampler (None)
    and the --pruner spec's pruner (given on the command line, it overrides the script's)."""
    sampler, pruner = pickle.loads(setup.parts) if setup.parts is not None else (None, None)
    return sampler, pruner if pruner is not None else pruner_of(setup.pruner)


def describe_pruner(pruner) -> str:
    """A pruner object as the first line and the table say it: its class and its settings."""
    import optuna

    if isinstance(pruner, optuna.pruners.NopPruner):
        return "none"
    settings = ", ".join(f"{k.lstrip('_')}={v!r}" for k, v in vars(pruner).items()
                         if isinstance(v, (bool, int, float, str)))
    return f"{type(pruner).__name__}({settings})"


def pruner_text(setup) -> str:
    if setup.parts is not None and pickle.loads(setup.parts)[1] is not None:
        return f"the script's {describe_pruner(parts_of(setup)[1])}"
    return parse_pruner(setup.pruner).describe()


def storage_of(url: str):
    import optuna

    # several processes write the file: wait for SQLite's lock instead of failing at once
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})


def counted(t) -> bool:
    """Whether a trial counts toward --trials: complete, pruned, or failed while it ran (a worker
    that died with it included); not one a stopped sweep interrupted, nor one that fit nowhere."""
    from optuna.trial import TrialState

    return t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
        t.state == TrialState.FAIL and not t.user_attrs.get("interrupted") and not t.user_attrs.get("unplaced"))
