"""The job's configuration: keyword-only, validated, and every error names the fix."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace

from ..errors import UsageError

LAUNCH_ENV = "HETRAIN_LAUNCH"   # path to the launch file `hetrain run` writes for its workers

LOSS_WEIGHTINGS = ("samples", "tokens")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class Config:
    global_batch: int                    # samples per optimizer step, over all devices together
    seed: int = 0                        # data order and anything else hetrain randomises
    loss_weighting: str = "samples"      # 'samples': mean over samples; 'tokens': pass tokens= to backward()
    drop_last: bool = False              # False: a step may straddle two epochs (nothing dropped)
    shuffle: bool = True
    precision: str = "fp32"              # fp32 | bf16 | fp16 autocast
    micro_batch: int | None = None       # cap on every device's micro-batch (None: from memory)
    max_steps: int | None = None         # stop after this many optimizer steps...
    epochs: float | None = None          # ...or after this many passes over the data (default 1)
    grad_clip: float | None = None       # clip the global gradient norm to this
    emulate: str | None = None           # cluster spec: one emulated device per rank
    plan: str | None = None              # path of a saved Plan (JSON) to run instead of splitting
    timeout_s: float = 600.0             # collective timeout: a hung peer becomes an error
    memory_margin: float = 0.10          # fraction of device memory kept free when sizing micro-batches
    verbose: bool = True                 # rank 0 prints the plan and summaries

    def __post_init__(self) -> None:
        def bad(what: str, fix: str) -> UsageError:
            return UsageError(f"hetrain.init: {what}", fix)

        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise bad(f"global_batch={self.global_batch!r} must be a positive integer",
                      "pass global_batch=N, the samples per optimizer step over all devices")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise bad(f"loss_weighting={self.loss_weighting!r}", f"use one of {LOSS_WEIGHTINGS}")
        if self.precision not in PRECISIONS:
            raise bad(f"precision={self.precision!r}", f"use one of {PRECISIONS}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise bad(f"micro_batch={self.micro_batch}", "use a positive cap, or None")
        if self.max_steps is not None and self.max_steps < 0:
            raise bad(f"max_steps={self.max_steps}", "use a number of steps >= 0, or None")
        if self.epochs is not None and not self.epochs > 0:
            raise bad(f"epochs={self.epochs}", "use a positive number of epochs, or None")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise bad(f"grad_clip={self.grad_clip}", "use a positive max norm, or None")
        if not self.timeout_s > 0:
            raise bad(f"timeout_s={self.timeout_s}", "use a positive number of seconds")
        if not 0 <= self.memory_margin < 1:
            raise bad(f"memory_margin={self.memory_margin}", "use a fraction in [0, 1)")

    def with_launch_file(self) -> Config:
        """Apply what `hetrain run` put in the launch file: the command line beats the script."""
        path = os.environ.get(LAUNCH_ENV)
        if not path:
            return self
        with open(path) as f:
            launch = json.load(f)
        known = {f.name for f in fields(self)}
        overrides = {k: v for k, v in launch.get("config", {}).items() if k in known and v is not None}
        return replace(self, **overrides)

    def to_dict(self) -> dict:
        return asdict(self)
