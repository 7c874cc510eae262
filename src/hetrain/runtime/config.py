"""The job's configuration: keyword-only, validated, and every error names the fix.

The user's knobs sit at the top level; the rest come in groups (config_groups.py): memory=Memory(...),
checkpoints=Checkpoints(...), rebalancing=Rebalancing(...), compression=Compression(...),
reporting=Reporting(...), and emulation=Emulation(...) (the launcher's and the tests', not a script's).
Every entry point (hetrain.init, the Fabric strategy, the HF Trainer's hetrain={...}, `hetrain plan`'s
saved config) builds it through `make_config`, so a keyword of an older hetrain gets one error naming
its new place.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import UsageError, did_you_mean
from ..vocabulary import LOSS_WEIGHTINGS, PRECISION_REQUESTS
from .config_groups import (GROUPS, Checkpoints, Compression, Emulation, Memory, Rebalancing, Reporting, as_group,
                            bad, check_types)

LAUNCH_ENV = "HETRAIN_LAUNCH"   # path to the launch file `hetrain run` writes for its workers
METRICS_SUBDIR = "metrics"      # Reporting.metrics_dir's default, inside Checkpoints.dir: the figures stay with it

# The keywords of the flat Config this one replaced -> (group field, the group's field). One table:
# make_config's error and its test both read it, so they cannot drift apart.
RENAMED: dict[str, tuple[str, str]] = {
    "checkpoint_dir": ("checkpoints", "dir"), "checkpoint_every": ("checkpoints", "every"),
    "keep_checkpoints": ("checkpoints", "keep"), "resume": ("checkpoints", "resume"),
    "preempt_grace_s": ("checkpoints", "preempt_grace_s"),
    "rebalance": ("rebalancing", "enabled"), "rebalance_threshold": ("rebalancing", "threshold"),
    "compression": ("compression", "method"),       # the same name: a bare string is the old form
    "powersgd_rank": ("compression", "powersgd_rank"),
    "memory_margin": ("memory", "margin"), "micro_batch": ("memory", "max_micro_batch"),
    "checkpointing": ("memory", "activation_checkpointing"), "checkpoint_blocks": ("memory", "blocks"),
    "oom_recovery": ("memory", "oom_recovery"),
    "verbose": ("reporting", "verbose"), "status_every": ("reporting", "status_every"),
    "metrics_dir": ("reporting", "metrics_dir"), "sample_log": ("reporting", "sample_log"),
    "emulate": ("emulation", "cluster"), "emulate_sample_s": ("emulation", "sample_s"),
    "emulate_micro_s": ("emulation", "micro_s"), "emulate_link_gbs": ("emulation", "link_gbs"),
    "faults": ("emulation", "faults"),
}
# Keywords that left Config for a layout object, which prepare(parallel=...) takes (layout_spec.py):
# how a layout runs is said where the layout is chosen.
# The sharding has one home, DataParallel(sharding=): the layout is what runs it.
TO_LAYOUT = {"tp_split": ("TensorParallel(split=...)", "ht.prepare(..., parallel=hetrain.TensorParallel(split={value!r}))"),
             "sharding": ("DataParallel(sharding=...)",
                          "ht.prepare(..., parallel=hetrain.DataParallel(sharding={value!r}))")}
# A plan enters one way per level: init(plan=) for the job, prepare(parallel=plan) for one prepare.
PLAN_WAYS = ("pass hetrain.init(plan=path_or_Plan) for the job, or ht.prepare(..., parallel=plan) for one "
             "prepare")
# What an integration's hetrain={...} holds beside Config's keywords: init's plan, and the sharding
# of the DataParallel it runs (integration_layout maps it to the layout object).
INTEGRATION_KEYWORDS = ("plan", "sharding")


@dataclass(frozen=True, kw_only=True)
class Config:
    global_batch: int                    # samples per optimizer step, over all devices together
    seed: int = 0                        # data order and anything else hetrain randomises
    loss_weighting: str = "samples"      # 'samples': mean over samples; 'tokens': pass tokens= to backward()
    drop_last: bool = False              # False: a step may straddle two epochs (nothing dropped)
    shuffle: bool = True
    num_workers: int = 0                 # worker processes reading micro-batches (0: this process)
    precision: str = "fp32"              # fp32 | auto (per device: bf16 where real, else fp16 + one
                                         # job-wide loss scale) | bf16 | fp16 autocast
    allow_fallback: bool = False         # a device that cannot run `precision` runs the nearest it can
    max_steps: int | None = None         # stop after this many optimizer steps...
    epochs: float | None = None          # ...or after this many passes over the data (default 1)
    grad_clip: float | None = None       # clip the global gradient norm to this
    timeout_s: float = 600.0             # collective timeout: a hung peer becomes an error
    # the groups (config_groups.py); each also accepts a dict of its fields
    memory: Memory = field(default_factory=Memory)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    rebalancing: Rebalancing = field(default_factory=Rebalancing)
    compression: Compression = field(default_factory=Compression)
    reporting: Reporting = field(default_factory=Reporting)
    emulation: Emulation = field(default_factory=Emulation)

    def __post_init__(self) -> None:
        for name in GROUPS:         # a dict (JSON) becomes its group, checked there
            value = getattr(self, name)
            if name == "compression" and isinstance(value, str):
                raise renamed_error({name: value})
            object.__setattr__(self, name, as_group(name, value))
        check_types(self)           # types first: the checks below compare numbers
        if self.global_batch < 1:
            raise bad(f"global_batch={self.global_batch!r} must be a positive integer",
                      "pass global_batch=N, the samples per optimizer step over all devices")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise bad(f"loss_weighting={self.loss_weighting!r}", f"use one of {LOSS_WEIGHTINGS}")
        if self.precision not in PRECISION_REQUESTS:
            raise bad(f"precision={self.precision!r}", f"use one of {PRECISION_REQUESTS}")
        if self.max_steps is not None and self.max_steps < 0:
            raise bad(f"max_steps={self.max_steps}", "use a number of steps >= 0, or None")
        if self.epochs is not None and not self.epochs > 0:
            raise bad(f"epochs={self.epochs}", "use a positive number of epochs, or None")
        if self.num_workers < 0:
            raise bad(f"num_workers={self.num_workers}", "use 0 (read in this process) or a number of worker processes")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise bad(f"grad_clip={self.grad_clip}", "use a positive max norm, or None")
        if not self.timeout_s > 0:
            raise bad(f"timeout_s={self.timeout_s}", "use a positive number of seconds")

    def with_launch_file(self) -> Config:
        """Apply what `hetrain run` put in the launch file: its `config` (the command line) beats the
        script; its `defaults` fill only what the script left unset. Both go field by field, inside
        the groups too: `{"checkpoints": {"dir": D}}` sets the directory and keeps the script's `every`."""
        path = os.environ.get(LAUNCH_ENV)
        if not path:
            return self
        try:
            with open(path) as f:
                launch = json.load(f)
            if not isinstance(launch, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read the launch file {path!r} ({LAUNCH_ENV}): {e}",
                             f"unset {LAUNCH_ENV}; `hetrain run` sets it for its workers") from None
        merged = self.to_dict()
        for layer, wins in ((launch.get("defaults", {}), False), (launch.get("config", {}), True)):
            for name, value in layer.items():
                if name in GROUPS and isinstance(value, dict):
                    for key, v in value.items():
                        if v is not None and (wins or merged[name].get(key) is None):
                            merged[name][key] = v
                elif name in merged and value is not None and (wins or merged[name] is None):
                    merged[name] = value
        return Config(**merged)

    def metrics_path(self) -> str | None:
        """Where metrics.jsonl goes: Reporting.metrics_dir, or Checkpoints.dir/metrics; None: nowhere."""
        metrics_dir, checkpoint_dir = self.reporting.metrics_dir, self.checkpoints.dir
        if metrics_dir is not None:
            return metrics_dir or None
        return os.path.join(checkpoint_dir, METRICS_SUBDIR) if checkpoint_dir else None

    def to_dict(self) -> dict:
        """Plain values and a dict per group: JSON as it is, and `Config(**cfg.to_dict()) == cfg`."""
        return asdict(self)


def renamed_error(old: dict[str, Any], *, where: str = "hetrain.init") -> UsageError:
    """One error for every keyword of the flat Config given: each one's new place, and the fix with
    the import and the groups as they should be written."""
    moved: dict[str, dict[str, Any]] = {}
    said = []
    for name, value in old.items():
        group, key = RENAMED[name]
        moved.setdefault(group, {})[key] = value
        said.append(f"{name}= is now {group}={GROUPS[group].__name__}({key}=...)")
    what = "; ".join(said)
    classes = ", ".join(GROUPS[g].__name__ for g in moved)
    calls = ", ".join(f"{g}={GROUPS[g].__name__}(" + ", ".join(f"{k}={v!r}" for k, v in keys.items()) + ")"
                      for g, keys in moved.items())
    return UsageError(f"{where}: {what}", f"from hetrain import {classes}; then pass {calls}")


def check_keywords(keywords: dict[str, Any], *, where: str = "hetrain.init") -> None:
    """Config's keywords as given: an old one (RENAMED) is one error naming its new place; an
    unknown one, one error with the close names."""
    known = [f.name for f in fields(Config)]
    # compression= is both: a group now, a bare string ('fp16') before
    old = {k: v for k, v in keywords.items()
           if k in RENAMED and (k not in known or (k == "compression" and isinstance(v, str)))}
    if old:
        raise renamed_error(old, where=where)
    refuse_moved(keywords, where=where)
    for name in keywords:
        if name not in known:
            raise UsageError(f"{where}: unknown keyword {name!r}{close_names(name)}",
                             f"remove {name}=, or use a keyword of hetrain.Config")


def refuse_moved(keywords: dict[str, Any], *, where: str) -> None:
    """A keyword that left Config for the layout object (TO_LAYOUT) or for init(plan=): one error
    naming its place."""
    for name, value in keywords.items():
        if name in TO_LAYOUT:
            layout, fix = TO_LAYOUT[name]
            raise UsageError(f"{where}: {name}= is now part of the layout: {layout}",
                             f"remove {name}= and pass " + fix.format(value=value))
        if name == "plan":
            raise UsageError(f"{where}: plan= is not a setting of the job's configuration", PLAN_WAYS)


def integration_layout(keywords: dict[str, Any]):
    """An integration's hetrain={...} (the HF Trainer, Fabric, Accelerate: data parallelism only)
    as (init's keywords, the layout object prepare() runs): its `sharding` is DataParallel's."""
    from ..layout_spec import DataParallel

    rest = {k: v for k, v in keywords.items() if k != "sharding"}
    return rest, DataParallel(sharding=keywords.get("sharding"))


def close_names(name: str) -> str:
    """' (did you mean: ...?)' over Config's keywords, an old keyword shown at its new place
    (a misspelt `checkpoint_evry` is pointed at `checkpoints=Checkpoints(every=...)`)."""
    spelled = {f.name: f.name for f in fields(Config)}
    spelled.update({old: f"{g}={GROUPS[g].__name__}({k}=...)" for old, (g, k) in RENAMED.items() if old not in spelled})
    return did_you_mean(name, spelled, shown=spelled)


def make_config(keywords: dict[str, Any], *, where: str = "hetrain.init") -> Config:
    """Config from keywords as any entry point has them, each problem one UsageError naming the fix."""
    check_keywords(keywords, where=where)
    return Config(**keywords)


def _refusing_moved(init):
    """Config(sharding=...) and Config(plan=...) name their new place in one line, as init's do,
    rather than Python's unexpected-keyword TypeError."""
    def __init__(self, **keywords):
        refuse_moved(keywords, where="hetrain.Config")
        init(self, **keywords)

    __init__.__wrapped__ = init
    return __init__


# The dataclass's own signature stays what type checkers see (and __wrapped__ keeps it for inspect).
Config.__init__ = _refusing_moved(Config.__init__)  # type: ignore[method-assign]


__all__ = ["Config", "Checkpoints", "Compression", "Emulation", "Memory", "Rebalancing", "Reporting", "RENAMED",
           "LAUNCH_ENV", "METRICS_SUBDIR", "make_config", "check_keywords"]
