"""The job's configuration: keyword-only, validated, and every error names the fix.

The user's knobs sit at the top level; the rest come in groups (config_groups.py): memory=Memory(...),
checkpoints=Checkpoints(...), rebalancing=Rebalancing(...), compression=Compression(...),
reporting=Reporting(...), and emulation=Emulation(...) (the launcher's and the tests', not a script's).
Every entry point (hetrain.init, the Fabric strategy, the HF Trainer's hetrain={...}, `hetrain plan`'s
saved config) builds it through `make_config`, and `Config(...)` itself checks its keywords the same
way: an unknown one is one error with the close names or, for a word from another tool (WHERE), the
place the setting lives in hetrain.
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

# Words people bring from other tools (DeepSpeed, Accelerate, HF TrainingArguments) or from a layout
# object, each -> (where the setting lives in hetrain, the keyword to pass instead). An unknown
# keyword named here gets that place in one line rather than the close names.
_BATCH = ("global_batch=N, the samples per step over all devices: hetrain cuts each device's share into "
          "micro-batches itself (memory=Memory(max_micro_batch=...) caps one)", "global_batch=N")
_PRECISION = "precision=, one word for the job ('auto': bf16 where a device has it, else fp16)"
WHERE: dict[str, tuple[str, str]] = {
    "sharding": ("DataParallel(sharding=...) in prepare(parallel=...): the layout runs the sharding",
                 "ht.prepare(..., parallel=hetrain.DataParallel(sharding={value!r}))"),
    "tp_split": ("TensorParallel(split=...) in prepare(parallel=...)",
                 "ht.prepare(..., parallel=hetrain.TensorParallel(split={value!r}))"),
    "zero_stage": ("DataParallel(sharding=...) in prepare(parallel=...): ZeRO-1 is 'zero1', ZeRO-3 'fsdp'",
                   "ht.prepare(..., parallel=hetrain.DataParallel(sharding='zero1'))"),
    "checkpoint_dir": ("checkpoints=Checkpoints(dir=...) (or `hetrain run --checkpoint-dir`)",
                       "checkpoints=hetrain.Checkpoints(dir={value!r})"),
    "output_dir": ("checkpoints=Checkpoints(dir=...) (or `hetrain run --checkpoint-dir`)",
                   "checkpoints=hetrain.Checkpoints(dir={value!r})"),
    "save_steps": ("checkpoints=Checkpoints(every=...)", "checkpoints=hetrain.Checkpoints(every={value!r})"),
    "resume_from_checkpoint": ("checkpoints=Checkpoints(resume=...)", "checkpoints=hetrain.Checkpoints(resume='auto')"),
    "gradient_accumulation_steps": _BATCH,
    "micro_batch": _BATCH, "micro_batch_size": _BATCH, "batch_size": _BATCH, "per_device_train_batch_size": _BATCH,
    "train_batch_size": _BATCH, "train_micro_batch_size_per_gpu": _BATCH,
    "fp16": (_PRECISION, "precision='fp16'"), "bf16": (_PRECISION, "precision='bf16'"),
    "mixed_precision": (_PRECISION, "precision='bf16' (or 'fp16', 'auto')"),
    "max_grad_norm": ("grad_clip=", "grad_clip={value!r}"),
    "gradient_clipping": ("grad_clip=", "grad_clip={value!r}"),
    "gradient_checkpointing": ("memory=Memory(activation_checkpointing=...)",
                               "memory=hetrain.Memory(activation_checkpointing='all')"),
    "offload_optimizer": ("memory=Memory(offload_optimizer=...)", "memory=hetrain.Memory(offload_optimizer='always')"),
    "num_train_epochs": ("epochs=", "epochs={value!r}"),
    "dataloader_num_workers": ("num_workers=", "num_workers={value!r}"),
    "plan": ("init(plan=) for the job, or prepare(parallel=plan) for one prepare",
             "hetrain.init(plan=path_or_Plan), or ht.prepare(..., parallel=plan)"),
}
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

    def __new__(cls, *args, **keywords):
        # Config(sharding=...) gets the one line naming where the setting lives, as init() does,
        # not Python's unexpected-keyword TypeError
        check_keywords(keywords, where="hetrain.Config")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in GROUPS:         # a dict (JSON) becomes its group, checked there
            value = getattr(self, name)
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


def check_keywords(keywords: dict[str, Any], *, where: str = "hetrain.init") -> None:
    """Config's keywords as given: an unknown one is one UsageError naming where the setting lives
    (WHERE), or the close names."""
    known = [f.name for f in fields(Config)]
    for name, value in keywords.items():
        if name in known:
            continue
        if name in WHERE:
            place, fix = WHERE[name]
            raise UsageError(f"{where}: {name}= is not a keyword of hetrain.Config; it is {place}",
                             f"remove {name}= and pass " + fix.format(value=value))
        raise UsageError(f"{where}: unknown keyword {name!r}{did_you_mean(name, known)}",
                         f"remove {name}=, or use a keyword of hetrain.Config")


def integration_layout(keywords: dict[str, Any]):
    """An integration's hetrain={...} (the HF Trainer, Fabric, Accelerate: data parallelism only)
    as (init's keywords, the layout object prepare() runs): its `sharding` is DataParallel's."""
    from ..layout_spec import DataParallel

    rest = {k: v for k, v in keywords.items() if k != "sharding"}
    return rest, DataParallel(sharding=keywords.get("sharding"))


def make_config(keywords: dict[str, Any], *, where: str = "hetrain.init") -> Config:
    """Config from keywords as any entry point has them, each problem one UsageError naming the fix."""
    check_keywords(keywords, where=where)
    return Config(**keywords)


__all__ = ["Config", "Checkpoints", "Compression", "Emulation", "Memory", "Rebalancing", "Reporting", "WHERE",
           "LAUNCH_ENV", "METRICS_SUBDIR", "make_config", "check_keywords"]
