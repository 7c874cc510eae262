"""The Plan: what every rank does in one optimizer step. Frozen, serialisable, versioned.

A Plan is the single thing ranks agree on. Planning code builds Plans without touching
torch.distributed; the runtime executes one and, when the ranks agree to change it (rebalancing,
OOM recovery), replaces it with a new Plan whose `version` is one higher.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

SCHEMA = 2
READABLE_SCHEMAS = (1, 2)   # 2 added predicted per-device figures and excluded devices (all optional)


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """`total` into `parts` sizes that differ by at most one, larger first: 19, 3 -> 7, 6, 6."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} into {parts} non-empty parts")
    q, r = divmod(total, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


@dataclass(frozen=True, kw_only=True)
class DevicePlan:
    """One rank's part of a step."""

    rank: int
    device: str                          # e.g. 'rtx3090#1 (emulated)' or 'cuda:1 NVIDIA A100-SXM4-80GB'
    speed: float                         # relative throughput weight the split used
    share: int                           # samples of the global batch this rank computes per step
    micro_batch: int                     # largest micro-batch this rank runs
    max_micro_batch: int | None = None   # what its memory allows (None: no limit known)
    precision: str = "fp32"              # fp32 | bf16 | fp16
    checkpointing: bool = False          # activation checkpointing on this rank
    memory_cap_bytes: int | None = None  # emulated cap or real device memory
    per_sample_s: float | None = None    # measured: compute seconds per sample on this device...
    fixed_s: float | None = None         # ...plus these per micro-batch, whatever its size
    reasons: tuple[str, ...] = ()        # why each number was chosen, for people
    predicted_compute_s: float | None = None    # planner: this rank's compute seconds per step
    predicted_memory_bytes: int | None = None   # planner: this rank's peak memory

    def __post_init__(self) -> None:
        if self.share < 1 or self.micro_batch < 1:
            raise ValueError(f"rank {self.rank}: share and micro-batch must be >= 1, "
                             f"got share={self.share}, micro_batch={self.micro_batch}")

    @property
    def n_micro(self) -> int:
        return math.ceil(self.share / self.micro_batch)

    def micro_sizes(self) -> tuple[int, ...]:
        """This rank's micro-batch sizes for one step, as even as possible (19 by 8 -> 7, 6, 6)."""
        return split_evenly(self.share, self.n_micro)


@dataclass(frozen=True, kw_only=True)
class ExcludedDevice:
    """A device the planner leaves out, why, and what would bring it in."""

    device: str
    reason: str                          # e.g. 'too slow to help: ...' or 'does not fit one sample: ...'
    fix: str                             # what would make it take part
    kind: str = "slow"                   # 'slow' | 'memory'


@dataclass(frozen=True, kw_only=True)
class Plan:
    global_batch: int
    devices: tuple[DevicePlan, ...]
    version: int = 0
    note: str = ""                                   # why this plan (e.g. 'rebalanced: ...')
    predicted: dict[str, float] = field(default_factory=dict)  # planner estimates, if any
    excluded: tuple[ExcludedDevice, ...] = ()        # devices left out, with the reason

    def __post_init__(self) -> None:
        total = sum(d.share for d in self.devices)
        if total != self.global_batch:
            raise ValueError(f"shares {[d.share for d in self.devices]} sum to {total}, "
                             f"not the global batch {self.global_batch}")
        if [d.rank for d in self.devices] != list(range(len(self.devices))):
            raise ValueError("device plans must be ordered by rank 0..W-1")

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def shares(self) -> tuple[int, ...]:
        return tuple(d.share for d in self.devices)

    def offsets(self) -> tuple[int, ...]:
        """Start of each rank's contiguous slice within a step's global batch."""
        out, acc = [], 0
        for d in self.devices:
            out.append(acc)
            acc += d.share
        return tuple(out)

    def evolve(self, *, note: str, devices: tuple[DevicePlan, ...] | None = None, **changes) -> Plan:
        """A successor plan (version + 1) with some fields changed."""
        return replace(self, devices=devices if devices is not None else self.devices,
                       version=self.version + 1, note=note, **changes)

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        schema = data.pop("schema", None)
        if schema not in READABLE_SCHEMAS:
            raise ValueError(f"plan schema {schema} is not {SCHEMA}: re-plan with this hetrain")
        devices = tuple(DevicePlan(**{**d, "reasons": tuple(d.get("reasons", ()))})
                        for d in data.pop("devices"))
        excluded = tuple(ExcludedDevice(**e) for e in data.pop("excluded", ()))
        return cls(devices=devices, excluded=excluded, **data)
