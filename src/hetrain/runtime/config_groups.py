"""The groups of a job's configuration (Config's fields memory=, checkpoints=, ...): small frozen,
keyword-only dataclasses, each validating its own fields; every error names the fix.

    from hetrain import Checkpoints, Memory
    hetrain.init(global_batch=64, checkpoints=Checkpoints(dir="ckpt", every=100), memory=Memory(margin=0.2))

A group field of Config also takes a plain dict of the group's fields (what JSON gives back: a saved
config, the launch file, the HF Trainer's hetrain={...}). Importing this module must stay cheap: no torch.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any

from ..errors import UsageError, did_you_mean
from ..vocabulary import CHECKPOINTINGS, COMPRESSION_REQUESTS, RESUME_MODES

# What each annotation accepts: a bool is not a number here, and a float field takes an int.
_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
_WORDS = {"int": "a whole number", "float": "a finite number", "bool": "True or False", "str": "a string"}


def bad(what: str, fix: str) -> UsageError:
    return UsageError(f"hetrain.init: {what}", fix)


def check_types(obj: Any, label: str = "") -> None:
    """Each plain field's value against its annotation (types first: the checks after compare
    numbers). `label`: how the error names the field's owner, e.g. 'Checkpoints(every=...)'."""
    for f in fields(obj):
        base, _, optional = str(f.type).partition(" | ")
        value, types = getattr(obj, f.name), _TYPES.get(base)
        if types is None or (value is None and optional == "None"):
            continue
        if (not isinstance(value, types) or (base != "bool" and isinstance(value, bool))
                or (base == "float" and not math.isfinite(float(value)))):
            kind = _WORDS[base] + (" (or None)" if optional == "None" else "")
            where = f"{label}({f.name}={value!r})" if label else f"{f.name}={value!r}"
            raise bad(f"{where} is not {kind}", f"pass {f.name}= as {kind}"
                      + (", or leave it out" if f.default is not MISSING else ""))


@dataclass(frozen=True, kw_only=True)
class Checkpoints:
    """State checkpoints: where they go, how often, how many stay, and whether the job resumes."""

    dir: str | None = None           # where checkpoints go (None: no checkpoints)
    every: int = 50                  # steps between checkpoints (and one at the end)
    keep: int = 3                    # the newest K are kept
    resume: str = "auto"             # auto: from the newest whole checkpoint if any | must | never
    preempt_grace_s: float = 30.0    # after SIGTERM/SIGINT, how long to wait for the step boundary
                                     # and its checkpoint before leaving anyway (resilience/preempt.py)

    def __post_init__(self) -> None:
        check_types(self, "Checkpoints")
        if self.every < 1 or self.keep < 1:
            raise bad(f"Checkpoints(every={self.every}, keep={self.keep})",
                      "use positive numbers, e.g. Checkpoints(every=50, keep=3)")
        if self.resume not in RESUME_MODES:
            raise bad(f"Checkpoints(resume={self.resume!r})", f"use one of {RESUME_MODES}")
        if self.resume == "must" and not self.dir:
            raise bad("Checkpoints(resume='must') without a dir",
                      "pass Checkpoints(dir=..., resume='must') (or --checkpoint-dir) to resume from")
        if not 0 < self.preempt_grace_s <= 3600:
            raise bad(f"Checkpoints(preempt_grace_s={self.preempt_grace_s!r})",
                      "give the seconds to wait for the step boundary after SIGTERM, e.g. 30 (at most 3600)")


@dataclass(frozen=True, kw_only=True)
class Rebalancing:
    """Moving shares between devices when their measured speeds change (runtime/resilience/rebalance.py)."""

    enabled: bool = True
    threshold: float = 0.08          # ...only for a predicted step-time gain above this

    def __post_init__(self) -> None:
        check_types(self, "Rebalancing")
        if not 0 <= self.threshold:
            raise bad(f"Rebalancing(threshold={self.threshold})", "use a fraction >= 0, e.g. 0.08")


@dataclass(frozen=True, kw_only=True)
class Compression:
    """Gradient compression of data parallelism's all-reduce (DDP comm hooks; planning/compression.py
    says when 'auto' picks one)."""

    method: str = "auto"             # auto | none | fp16 | bf16 | powersgd
    powersgd_rank: int = 4           # PowerSGD's matrix approximation rank (method='powersgd')

    def __post_init__(self) -> None:
        check_types(self, "Compression")
        if self.method not in COMPRESSION_REQUESTS:
            raise bad(f"Compression(method={self.method!r})", f"use one of {COMPRESSION_REQUESTS}")
        if not 1 <= self.powersgd_rank <= 1024:
            raise bad(f"Compression(powersgd_rank={self.powersgd_rank!r})",
                      "give PowerSGD's matrix approximation rank, a whole number from 1 to 1024 (e.g. 4)")


OFFLOAD_MODES = ("auto", "never", "always")     # Memory(offload_optimizer=...)


@dataclass(frozen=True, kw_only=True)
class Memory:
    """How device memory is used: the margin kept free, the micro-batch cap, activation checkpointing,
    optimizer-state offload."""

    margin: float = 0.10                    # fraction of device memory kept free when sizing micro-batches
    max_micro_batch: int | None = None      # cap on every device's micro-batch (None: from memory)
    activation_checkpointing: str = "plan"  # recompute blocks' activations: where the plan says | all | none
    blocks: str | None = None               # class name of the model's repeated blocks: what activation
                                            # checkpointing, fault hooks and FSDP units wrap (None: every
                                            # ModuleList's)
    oom_recovery: bool = True               # shrink a rank's micro-batch on OOM and redo (resilience/oom.py)
    offload_optimizer: str = "auto"         # optimizer state in host memory (runtime/memory/offload.py):
                                            # auto: on the ranks the plan says | always: every rank |
                                            # never: none (a plan that needs it is refused)

    def __post_init__(self) -> None:
        check_types(self, "Memory")
        if not 0 <= self.margin < 1:
            raise bad(f"Memory(margin={self.margin})", "use a fraction in [0, 1), e.g. 0.1")
        if self.max_micro_batch is not None and self.max_micro_batch < 1:
            raise bad(f"Memory(max_micro_batch={self.max_micro_batch})", "use a positive cap, or None")
        if self.activation_checkpointing not in CHECKPOINTINGS:
            raise bad(f"Memory(activation_checkpointing={self.activation_checkpointing!r})",
                      f"use one of {CHECKPOINTINGS}")
        if self.offload_optimizer not in OFFLOAD_MODES:
            raise bad(f"Memory(offload_optimizer={self.offload_optimizer!r})", f"use one of {OFFLOAD_MODES}")
        if self.blocks is not None and not self.blocks.isidentifier():
            raise bad(f"Memory(blocks={self.blocks!r})",
                      "give the class name of the model's blocks, e.g. Memory(blocks='Block')")


@dataclass(frozen=True, kw_only=True)
class Reporting:
    """What rank 0 prints and records."""

    verbose: bool = True             # rank 0 prints the plan and summaries
    details: bool = False            # verbose: also every reason behind the plan and the setup
                                     # (precision, probes, layout choice); `hetrain run/demo --verbose`
    status_every: int = 0            # verbose: rank 0 prints one status line every N steps (0: none)
    metrics_dir: str | None = None   # rank 0 appends metrics.jsonl here (runtime/loop/metrics.py); None:
                                     # Checkpoints.dir/metrics when checkpointing, else off; '': off
    sample_log: str | None = None    # directory: each rank logs the samples of every step

    def __post_init__(self) -> None:
        check_types(self, "Reporting")
        if self.status_every < 0:
            raise bad(f"Reporting(status_every={self.status_every})",
                      "use a number of steps >= 1, or 0 for no status lines")


@dataclass(frozen=True, kw_only=True)
class Emulation:
    """Emulated devices, their clock and injected faults. The launcher owns this group (`hetrain run
    --emulate/--faults/--emulate-link-gbs` write it into the launch file), and tests set it; a user's
    training script does not."""

    cluster: str | None = None       # cluster spec: one emulated device per rank
    sample_s: float | None = None    # a clock tests control: an emulated micro-batch of m samples
                                     # lasts m·this/speed, whatever its CPU took (None: CPU time)
    micro_s: float | None = None     # on that clock, a fixed part per micro-batch: (this + m·sample_s)/speed
    link_gbs: float | None = None    # emulated devices on several nodes: the inter-node link's GB/s;
                                     # gradient all-reduces and the link probe are slowed to it
                                     # (emulation/link.py; None: loopback, unthrottled)
    faults: str | None = None        # fault injection for tests/demos (runtime/devices/faults.py)

    def __post_init__(self) -> None:
        check_types(self, "Emulation")
        if self.cluster is not None and not self.cluster.strip():
            raise bad(f"Emulation(cluster={self.cluster!r}) names no devices",
                      "give a cluster spec, e.g. Emulation(cluster='a100-80g,rtx3090'), or None")
        if self.sample_s is not None and not 0 < self.sample_s <= 10:
            raise bad(f"Emulation(sample_s={self.sample_s!r})",
                      "give the controlled clock's seconds per sample, e.g. 0.002, or None for CPU time")
        if self.micro_s is not None and not (0 <= self.micro_s <= 10 and self.sample_s is not None):
            raise bad(f"Emulation(micro_s={self.micro_s!r})",
                      "give the controlled clock's fixed seconds per micro-batch (0 to 10, e.g. 0.004) together "
                      "with sample_s, or None")
        if self.link_gbs is not None and not 0 < self.link_gbs <= 10_000:
            raise bad(f"Emulation(link_gbs={self.link_gbs!r})",
                      "give the emulated inter-node link's bandwidth in GB/s (0 < GB/s <= 10000), e.g. "
                      "Emulation(link_gbs=1.0), or None for an unthrottled link")


# Config's group fields: the field's name -> its group
GROUPS: dict[str, type] = {"memory": Memory, "checkpoints": Checkpoints, "rebalancing": Rebalancing,
                           "compression": Compression, "reporting": Reporting, "emulation": Emulation}


def group_fields(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def as_group(name: str, value: Any) -> Any:
    """Config's field `name` as its group: the group itself, or a dict of its fields. Anything
    else, or an unknown key, is one UsageError naming the group's fields."""
    cls = GROUPS[name]
    if isinstance(value, cls):
        return value
    known = group_fields(cls)
    takes = f"{cls.__name__} takes {', '.join(known)}"
    if not isinstance(value, dict):
        raise bad(f"{name}={value!r} is not a {cls.__name__} (or a dict of its fields)",
                  f"from hetrain import {cls.__name__}; pass {name}={cls.__name__}(...) ({takes})")
    for key in value:
        if key not in known:
            raise bad(f"{name}={{{key!r}: ...}}: {cls.__name__} has no field {key!r}"
                      f"{did_you_mean(str(key), known)}", takes)
    return cls(**value)
