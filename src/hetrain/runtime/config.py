"""The job's configuration: keyword-only, validated, and every error names the fix."""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, fields, replace

from ..errors import UsageError
from ..vocabulary import (CHECKPOINTINGS, COMPRESSION_REQUESTS, LOSS_WEIGHTINGS, PRECISION_REQUESTS, RESUME_MODES,
                          SHARDING_REQUESTS, TP_SPLITS)

LAUNCH_ENV = "HETRAIN_LAUNCH"   # path to the launch file `hetrain run` writes for its workers
METRICS_SUBDIR = "metrics"      # metrics_dir's default, inside checkpoint_dir: the run's figures stay with it
# What each annotation accepts: a bool is not a number here, and a float field takes an int.
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_WORDS = {"int": "a whole number", "float": "a finite number", "bool": "True or False", "str": "a string"}

@dataclass(frozen=True, kw_only=True)
class Config:
    global_batch: int                    # samples per optimizer step, over all devices together
    seed: int = 0                        # data order and anything else hetrain randomises
    loss_weighting: str = "samples"      # 'samples': mean over samples; 'tokens': pass tokens= to backward()
    drop_last: bool = False              # False: a step may straddle two epochs (nothing dropped)
    shuffle: bool = True
    precision: str = "fp32"              # fp32 | auto (per device: bf16 where real, else fp16 + one
                                         # job-wide loss scale) | bf16 | fp16 autocast
    allow_fallback: bool = False         # a device that cannot run `precision` runs the nearest it can
    sharding: str = "auto"               # auto: shard only when the model does not fit | none (DDP) | zero1
                                         # | fsdp | capacity (optimizer state split by free memory)
                                         # | capacity-full (parameters, gradients and state split so)
    checkpointing: str = "plan"          # activation checkpointing: where the plan says | all | none
    checkpoint_blocks: str | None = None # class name of the blocks to checkpoint (None: every ModuleList's)
    micro_batch: int | None = None       # cap on every device's micro-batch (None: from memory)
    max_steps: int | None = None         # stop after this many optimizer steps...
    epochs: float | None = None          # ...or after this many passes over the data (default 1)
    grad_clip: float | None = None       # clip the global gradient norm to this
    emulate: str | None = None           # cluster spec: one emulated device per rank
    emulate_sample_s: float | None = None  # a clock tests control: an emulated micro-batch of m samples
                                         # lasts m·this/speed, whatever its CPU took (None: CPU time)
    emulate_micro_s: float | None = None   # on that clock, a fixed part per micro-batch: (this + m·sample_s)/speed
    emulate_link_gbs: float | None = None  # emulated devices on several nodes: the inter-node link's GB/s;
                                         # gradient all-reduces and the link probe are slowed to it
                                         # (runtime/devices/link.py; None: loopback, unthrottled)
    compression: str = "auto"            # gradient compression: auto | none | fp16 | bf16 | powersgd
                                         # (DDP comm hooks; planning/compression.py says when auto picks one)
    powersgd_rank: int = 4               # PowerSGD's matrix approximation rank (compression='powersgd')
    tp_split: str = "even"               # parallel='tp': every layer evenly (DTensor) | speed: heads and MLP
                                         # columns in proportion to each device's speed (parallel/tensor_uneven.py)
    plan: str | None = None              # path of a saved Plan (JSON) to run instead of splitting
    timeout_s: float = 600.0             # collective timeout: a hung peer becomes an error
    memory_margin: float = 0.10          # fraction of device memory kept free when sizing micro-batches
    verbose: bool = True                 # rank 0 prints the plan and summaries
    status_every: int = 0                # verbose: rank 0 prints one status line every N steps (0: none)
    metrics_dir: str | None = None       # rank 0 appends metrics.jsonl here (runtime/loop/metrics.py); None:
                                         # checkpoint_dir/metrics when checkpointing, else off; '': off
    # resilience
    rebalance: bool = True               # move shares when measured speeds change (runtime/resilience/rebalance.py)
    rebalance_threshold: float = 0.08    # ...only for a predicted step-time gain above this
    oom_recovery: bool = True            # shrink a rank's micro-batch on OOM and redo (runtime/resilience/oom.py)
    checkpoint_dir: str | None = None    # where checkpoints go (None: no checkpoints)
    checkpoint_every: int = 50           # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3            # the newest K are kept
    resume: str = "auto"                 # auto: from the newest whole checkpoint if any | must | never
    sample_log: str | None = None        # directory: each rank logs the samples of every step
    faults: str | None = None            # fault injection for tests/demos (runtime/devices/faults.py)
    preempt_grace_s: float = 30.0        # after SIGTERM/SIGINT, how long to wait for the step boundary
                                         # and its checkpoint before leaving anyway (resilience/preempt.py)

    def __post_init__(self) -> None:
        def bad(what: str, fix: str) -> UsageError:
            return UsageError(f"hetrain.init: {what}", fix)

        for f in fields(self):      # types first: the checks below compare numbers
            base, _, optional = str(f.type).partition(" | ")
            value, types = getattr(self, f.name), _TYPES.get(base)
            if types is None or (value is None and optional == "None"):
                continue
            if (not isinstance(value, types) or (base != "bool" and isinstance(value, bool))
                    or (base == "float" and not math.isfinite(float(value)))):
                kind = _WORDS[base] + (" (or None)" if optional == "None" else "")
                raise bad(f"{f.name}={value!r} is not {kind}", f"pass {f.name} as {kind}"
                          + (", or leave it out" if f.default is not MISSING else ""))
        if self.global_batch < 1:
            raise bad(f"global_batch={self.global_batch!r} must be a positive integer",
                      "pass global_batch=N, the samples per optimizer step over all devices")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise bad(f"loss_weighting={self.loss_weighting!r}", f"use one of {LOSS_WEIGHTINGS}")
        if self.precision not in PRECISION_REQUESTS:
            raise bad(f"precision={self.precision!r}", f"use one of {PRECISION_REQUESTS}")
        if self.sharding not in SHARDING_REQUESTS:
            raise bad(f"sharding={self.sharding!r}", f"use one of {SHARDING_REQUESTS}")
        if self.checkpointing not in CHECKPOINTINGS:
            raise bad(f"checkpointing={self.checkpointing!r}", f"use one of {CHECKPOINTINGS}")
        if self.checkpoint_blocks is not None and not self.checkpoint_blocks.isidentifier():
            raise bad(f"checkpoint_blocks={self.checkpoint_blocks!r}",
                      "give the class name of the model's blocks, e.g. checkpoint_blocks='Block'")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise bad(f"micro_batch={self.micro_batch}", "use a positive cap, or None")
        if self.max_steps is not None and self.max_steps < 0:
            raise bad(f"max_steps={self.max_steps}", "use a number of steps >= 0, or None")
        if self.epochs is not None and not self.epochs > 0:
            raise bad(f"epochs={self.epochs}", "use a positive number of epochs, or None")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise bad(f"grad_clip={self.grad_clip}", "use a positive max norm, or None")
        if self.emulate_sample_s is not None and not 0 < self.emulate_sample_s <= 10:
            raise bad(f"emulate_sample_s={self.emulate_sample_s!r}",
                      "give the controlled clock's seconds per sample, e.g. 0.002, or None for CPU time")
        if self.emulate_micro_s is not None and not (0 <= self.emulate_micro_s <= 10 and self.emulate_sample_s is not None):
            raise bad(f"emulate_micro_s={self.emulate_micro_s!r}",
                      "give the controlled clock's fixed seconds per micro-batch (0 to 10, e.g. 0.004) together "
                      "with emulate_sample_s, or None")
        if self.emulate_link_gbs is not None and not 0 < self.emulate_link_gbs <= 10_000:
            raise bad(f"emulate_link_gbs={self.emulate_link_gbs!r}",
                      "give the emulated inter-node link's bandwidth in GB/s (0 < GB/s <= 10000), e.g. "
                      "emulate_link_gbs=1.0, or None for an unthrottled link")
        if self.tp_split not in TP_SPLITS:
            raise bad(f"tp_split={self.tp_split!r} is not one of {', '.join(TP_SPLITS)}",
                      "use tp_split='speed' (heads and MLP columns in proportion to each device's speed, for "
                      "parallel='tp' on mixed devices) or tp_split='even' (the default)")
        if self.compression not in COMPRESSION_REQUESTS:
            raise bad(f"compression={self.compression!r}", f"use one of {COMPRESSION_REQUESTS}")
        if not 1 <= self.powersgd_rank <= 1024:
            raise bad(f"powersgd_rank={self.powersgd_rank!r}",
                      "give PowerSGD's matrix approximation rank, a whole number from 1 to 1024 (e.g. 4)")
        if self.compression not in ("auto", "none") and self.sharding not in ("auto", "none"):
            raise bad(f"compression={self.compression!r} with sharding={self.sharding!r}: gradient compression "
                      "runs as a DDP communication hook of plain data parallelism only",
                      "use sharding='none' (plain DDP, 'dp') for gradient compression, or compression='auto'")
        if self.emulate is not None and not self.emulate.strip():
            raise bad("emulate='' names no devices", "give a cluster spec, e.g. emulate='a100-80g,rtx3090', or None")
        if not self.timeout_s > 0:
            raise bad(f"timeout_s={self.timeout_s}", "use a positive number of seconds")
        if not 0 <= self.memory_margin < 1:
            raise bad(f"memory_margin={self.memory_margin}", "use a fraction in [0, 1)")
        if self.resume not in RESUME_MODES:
            raise bad(f"resume={self.resume!r}", f"use one of {RESUME_MODES}")
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise bad(f"checkpoint_every={self.checkpoint_every}, keep_checkpoints={self.keep_checkpoints}",
                      "use positive numbers")
        if self.resume == "must" and not self.checkpoint_dir:
            raise bad("resume='must' without a checkpoint_dir", "pass checkpoint_dir= (or --run-dir) to resume from")
        if not 0 < self.preempt_grace_s <= 3600:
            raise bad(f"preempt_grace_s={self.preempt_grace_s!r}",
                      "give the seconds to wait for the step boundary after SIGTERM, e.g. 30 (at most 3600)")
        if self.status_every < 0:
            raise bad(f"status_every={self.status_every}", "use a number of steps >= 1, or 0 for no status lines")
        if not 0 <= self.rebalance_threshold:
            raise bad(f"rebalance_threshold={self.rebalance_threshold}", "use a fraction >= 0, e.g. 0.08")

    def with_launch_file(self) -> Config:
        """Apply what `hetrain run` put in the launch file: its `config` (the command line) beats the
        script; its `defaults` fill only what the script left unset."""
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
        known = {f.name for f in fields(self)}
        overrides = {k: v for k, v in launch.get("config", {}).items() if k in known and v is not None}
        defaults = {k: v for k, v in launch.get("defaults", {}).items() if k in known and getattr(self, k) is None}
        return replace(self, **defaults, **overrides)

    def metrics_path(self) -> str | None:
        """Where metrics.jsonl goes: metrics_dir, or checkpoint_dir/metrics; None: nowhere."""
        if self.metrics_dir is not None:
            return self.metrics_dir or None
        return os.path.join(self.checkpoint_dir, METRICS_SUBDIR) if self.checkpoint_dir else None

    def to_dict(self) -> dict:
        return asdict(self)
