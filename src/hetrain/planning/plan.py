"""The Plan: what every rank does in one optimizer step. Frozen, serialisable, versioned.

A Plan is the single thing ranks agree on. Planning code builds Plans without touching
torch.distributed; the runtime executes one and, when the ranks agree to change it (rebalancing,
OOM recovery), replaces it with a new Plan whose `version` is one higher.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

from ..vocabulary import COMPRESSIONS, LAYOUTS

SCHEMA = 6
# 2 added predicted per-device figures and excluded devices, 3 the layout, 4 the gradient
# compression, 5 the memory savers per device, 6 the layout object's record (all optional: older
# plans load with their defaults; a plan without the record reads its layout from `layout`)
READABLE_SCHEMAS = (1, 2, 3, 4, 5, 6)
# Which layout object runs each `layout` (layout_spec.py's class names).
LAYOUT_KINDS = {"dp": "DataParallel", "tp": "TensorParallel", "pp": "Pipeline", "dp-pp": "Pipeline"}



FROZEN = "plans are frozen: make a new one with dataclasses.replace(plan, ...)"


class FrozenDict(dict):
    """A Plan's mapping (`predicted`, `layout_spec`): read like a dict, written to JSON like one,
    refused when changed in place (the ranks agreed on the plan as it was)."""

    def _refuse(self, *args, **kwargs):
        from ..errors import UsageError

        raise UsageError("a Plan's mapping was changed in place", FROZEN)

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse   # type: ignore[assignment]

    def __hash__(self) -> int:      # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: kv[0])))

    def __reduce__(self):           # copy, deepcopy and pickle rebuild it whole
        return FrozenDict, (dict(self),)


def _freeze(record, **fields) -> None:
    """Set a frozen dataclass's fields to their immutable form (lists to tuples, dicts frozen)."""
    for name, value in fields.items():
        if value is not None and not isinstance(value, (tuple, FrozenDict)):
            object.__setattr__(record, name, FrozenDict(value) if isinstance(value, dict) else tuple(value))


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
    device: str                          # e.g. 'cuda:1 NVIDIA A100-SXM4-80GB'
    speed: float                         # relative throughput weight the split used
    share: int                           # samples of the global batch this rank computes per step
    micro_batch: int                     # largest micro-batch this rank runs
    max_micro_batch: int | None = None   # what its memory allows (None: no limit known)
    precision: str = "fp32"              # fp32 | bf16 | fp16
    checkpointing: bool = False          # activation checkpointing on this rank
    checkpoint_blocks: int | None = None  # with checkpointing: None every block, k the first k blocks
    offload_optimizer: bool = False      # this rank's optimizer state lives in host memory
    memory_cap_bytes: int | None = None  # the device's memory, or the cap it was given
    per_sample_s: float | None = None    # measured: compute seconds per sample on this device...
    fixed_s: float | None = None         # ...plus these per micro-batch, whatever its size
    reasons: tuple[str, ...] = ()        # why each number was chosen, for people
    predicted_compute_s: float | None = None    # planner: this rank's compute seconds per step
    predicted_memory_bytes: int | None = None   # planner: this rank's peak memory

    def __post_init__(self) -> None:
        _freeze(self, reasons=self.reasons)
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
    predicted: dict[str, float] = field(default_factory=FrozenDict)  # planner estimates, if any
    excluded: tuple[ExcludedDevice, ...] = ()        # devices left out, with the reason
    # How the model is spread. Ranks r·group … r·group + group − 1 form replica r: one pipeline
    # (pp, dp-pp: group = its stages) or one tensor-parallel group (tp). The ranks of a replica
    # compute the same samples, so they have the same share; the replicas' shares sum to the batch.
    layout: str = "dp"
    group: int = 1
    stage_blocks: tuple[int, ...] = ()               # pp, dp-pp: blocks per stage
    schedule: str = ""                               # pp, dp-pp: gpipe | 1f1b
    # What DDP's gradient all-reduce sends (planning/compression.py chose it, the reason is in
    # `note`): none | fp16 | bf16 | powersgd (runtime/sharding/comm_hooks.py runs it).
    compression: str = "none"
    # The layout object that runs it, as layout_spec.to_spec records it: {"kind": "DataParallel",
    # "sharding": "fsdp"}. None (a plan of schema 5 or older): layout_record() reads `layout`.
    layout_spec: dict | None = None

    def __post_init__(self) -> None:
        _freeze(self, devices=self.devices, predicted=self.predicted, excluded=self.excluded,
                stage_blocks=self.stage_blocks, layout_spec=self.layout_spec)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if self.layout_spec is not None:
            _check_layout_spec(self.layout_spec, self.layout)
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression {self.compression!r} is not one of {', '.join(COMPRESSIONS)}")
        if self.group < 1 or len(self.devices) % self.group:
            raise ValueError(f"{len(self.devices)} devices do not form replicas of {self.group}")
        for r in range(self.replicas):
            shares = {d.share for d in self.devices[r * self.group:(r + 1) * self.group]}
            if len(shares) != 1:
                raise ValueError(f"the ranks of replica {r} have different shares {sorted(shares)}")
        total = sum(self.replica_shares)
        if total != self.global_batch:
            raise ValueError(f"shares {list(self.replica_shares)} sum to {total}, "
                             f"not the global batch {self.global_batch}")
        if [d.rank for d in self.devices] != list(range(len(self.devices))):
            raise ValueError("device plans must be ordered by rank 0..W-1")
        if self.layout in ("pp", "dp-pp") and (sum(self.stage_blocks) < 1 or len(self.stage_blocks) != self.group):
            raise ValueError(f"a {self.layout} plan needs blocks for each of its {self.group} stages, "
                             f"got {list(self.stage_blocks)}")

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def shares(self) -> tuple[int, ...]:
        return tuple(d.share for d in self.devices)

    @property
    def replicas(self) -> int:
        return len(self.devices) // self.group

    @property
    def replica_shares(self) -> tuple[int, ...]:
        """Samples per replica (per rank under plain DP)."""
        return tuple(self.devices[r * self.group].share for r in range(self.replicas))

    def replica_of(self, rank: int) -> int:
        return rank // self.group

    def offsets(self) -> tuple[int, ...]:
        """Start of each rank's contiguous slice within a step's global batch (the ranks of one
        replica share theirs)."""
        starts = [0]
        for share in self.replica_shares:
            starts.append(starts[-1] + share)
        return tuple(starts[self.replica_of(d.rank)] for d in self.devices)

    def layout_record(self) -> dict:
        """The layout object this plan runs, as layout_spec.to_spec records it: `layout_spec`, or
        in an older plan what its `layout` says (a plan for one pipeline is Pipeline(stages=None),
        replicas of k stages stages=k)."""
        if self.layout_spec is not None:
            return dict(self.layout_spec)
        kind = LAYOUT_KINDS[self.layout]
        if kind == "Pipeline":
            return {"kind": kind, "stages": None if self.replicas == 1 else self.group,
                    "schedule": self.schedule or "1f1b"}
        return {"kind": kind}

    def describe_layout(self) -> str:
        if self.layout == "dp":
            return f"data parallel over {self.world_size} device(s)"
        if self.layout == "tp":
            return f"tensor parallel over {self.group} device(s)" + (
                f", {self.replicas} replicas" if self.replicas > 1 else "")
        head = f"{self.replicas} pipeline replicas × {self.group} stages" if self.replicas > 1 else \
            f"one pipeline of {self.group} stages"
        return f"{head} (blocks {'/'.join(map(str, self.stage_blocks))}, {self.schedule or '1f1b'})"

    def evolve(self, *, note: str, devices: tuple[DevicePlan, ...] | None = None, **changes) -> Plan:
        """A successor plan (version + 1) with some fields changed."""
        return replace(self, devices=devices if devices is not None else self.devices,
                       version=self.version + 1, note=note, **changes)

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The Plan in `text` (from to_json). Anything else, down to a field's type, is a ValueError
        naming what is wrong: a plan file is input, and a float share or a string must not get in."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("the plan nests too deeply to be one") from None
        _expect(data, dict, "the plan")
        schema = data.pop("schema", None)
        if schema not in READABLE_SCHEMAS:
            raise ValueError(f"plan schema {schema!r} is not {SCHEMA}: re-plan with this hetrain")
        _check_fields(data, _PLAN_FIELDS, "the plan")
        devices = _expect(data.pop("devices"), list, "the plan's devices")
        excluded = _expect(data.pop("excluded", []), list, "the plan's excluded devices")
        for i, d in enumerate(devices):
            _check_fields(_expect(d, dict, f"device {i}"), _DEVICE_FIELDS, f"device {i}")
        for i, e in enumerate(excluded):
            _check_fields(_expect(e, dict, f"excluded device {i}"), _EXCLUDED_FIELDS, f"excluded device {i}")
        predicted = data.get("predicted", {})
        if not all(isinstance(k, str) and _is_number(v) for k, v in predicted.items()):
            raise ValueError("the plan's predicted figures must be numbers by name")
        if "stage_blocks" in data:
            data["stage_blocks"] = tuple(data["stage_blocks"])
        return cls(devices=tuple(DevicePlan(**{**d, "reasons": tuple(d.get("reasons", ()))}) for d in devices),
                   excluded=tuple(ExcludedDevice(**e) for e in excluded), **data)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _optional(check):
    return lambda v: v is None or check(v)


# Each field a plan file may hold, and what its value must be (required ones are marked True).
_PLAN_FIELDS = {"global_batch": (_is_int, True), "devices": (lambda v: True, True), "version": (_is_int, False),
                "note": (lambda v: isinstance(v, str), False), "predicted": (lambda v: isinstance(v, dict), False),
                "excluded": (lambda v: True, False), "layout": (lambda v: isinstance(v, str), False),
                "group": (_is_int, False), "stage_blocks": (lambda v: isinstance(v, list) and all(map(_is_int, v)), False),
                "schedule": (lambda v: isinstance(v, str), False),
                "compression": (lambda v: isinstance(v, str), False),
                "layout_spec": (lambda v: v is None or isinstance(v, dict), False)}
_DEVICE_FIELDS = {
    "rank": (_is_int, True), "device": (lambda v: isinstance(v, str), True),
    "speed": (lambda v: _is_number(v) and math.isfinite(v) and v > 0, True),
    "share": (_is_int, True), "micro_batch": (_is_int, True), "max_micro_batch": (_optional(_is_int), False),
    "precision": (lambda v: isinstance(v, str), False), "checkpointing": (lambda v: isinstance(v, bool), False),
    "checkpoint_blocks": (_optional(lambda v: _is_int(v) and v >= 0), False),
    "offload_optimizer": (lambda v: isinstance(v, bool), False),
    "memory_cap_bytes": (_optional(_is_int), False), "per_sample_s": (_optional(_is_number), False),
    "fixed_s": (_optional(_is_number), False), "reasons": (_is_str_list, False),
    "predicted_compute_s": (_optional(_is_number), False), "predicted_memory_bytes": (_optional(_is_int), False)}
_EXCLUDED_FIELDS = {name: (lambda v: isinstance(v, str), name != "kind") for name in ("device", "reason", "fix", "kind")}


def _check_layout_spec(spec: dict, layout: str) -> None:
    """A layout record a layout object can be made from, of the family `layout` names (ValueError)."""
    from ..errors import UsageError
    from ..layout_spec import from_spec

    try:
        from_spec(spec)
    except UsageError as e:
        raise ValueError(f"the plan's layout_spec: {e.what}") from None
    if spec.get("kind") != LAYOUT_KINDS[layout]:
        raise ValueError(f"the plan's layout_spec {spec!r} is not a {layout!r} layout ({LAYOUT_KINDS[layout]})")


def _expect(value, kind: type, what: str):
    if not isinstance(value, kind):
        raise ValueError(f"{what} must be a JSON {'object' if kind is dict else 'list'}, not {type(value).__name__}")
    return value


def _check_fields(data: dict, schema: dict, what: str) -> None:
    unknown = sorted(set(data) - set(schema))
    if unknown:
        raise ValueError(f"{what} has unknown fields {unknown}")
    for name, (valid, required) in schema.items():
        if name not in data:
            if required:
                raise ValueError(f"{what} has no {name!r}")
        elif not valid(data[name]):
            raise ValueError(f"{what}: {name}={data[name]!r} is not valid")
