"""What the planner knows about a model and about each device running it. Pure data, JSON round-trip.

`ModelSpec` is the device-independent part (parameters, training FLOPs and activation bytes per
sample): given by hand, by a preset, or read off a measurement. `DeviceProfile` is one device
running one model: seconds per micro-batch as a function of its size, fitted as t(m) = a + b·m
(a: fixed cost of a micro-batch — kernel launches, Python, hooks; b: seconds per sample), the
optimizer step's seconds, fixed memory (parameters, gradients, optimizer state) and activation
memory as c + d·m. It comes from the profiler (measured) or from the cost model (estimated from
the catalog); `source` says which, for people.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

from ..errors import UsageError
from ..vocabulary import PRECISIONS
from .memory import check_trainable

PROFILE_SCHEMA = 1


def _positive(name: str, value: float, fix: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UsageError(f"{name} must be a positive number, got {value!r}", fix)


def _non_negative(name: str, value: float, fix: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise UsageError(f"{name} must be zero or more, got {value!r}", fix)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as the cost model sees it; activations are for one sample, no checkpointing."""

    name: str
    params: int                              # all parameters (trainable or not)
    flops_per_sample: float                  # training FLOPs (forward + backward) per sample
    activation_bytes_per_sample: float       # saved for backward, at `activation_precision`
    activation_precision: str = "bf16"       # the precision the activation figure is for
    checkpoint_fraction: float = 0.25        # activations kept under activation checkpointing
    assumptions: str = ""                    # how the numbers were obtained, for people
    blocks: int | None = None                # equal blocks (layers) a pipeline can cut between, if any
    trainable_params: int | None = None      # fine-tuning: those with gradients and optimizer state (None: all)

    def __post_init__(self) -> None:
        fix = "give positive sizes, e.g. --params 124e6 --flops-per-sample 8.8e11 --activation-bytes 6.3e8"
        if not isinstance(self.params, int) or isinstance(self.params, bool) or self.params < 1:
            raise UsageError(f"model {self.name!r}: params must be a positive integer, got {self.params!r}", fix)
        check_trainable(self.params, self.trainable_params, f"model {self.name!r}")
        _positive(f"model {self.name!r}: flops per sample", self.flops_per_sample, fix)
        _positive(f"model {self.name!r}: activation bytes per sample", self.activation_bytes_per_sample, fix)
        if self.activation_precision not in PRECISIONS:
            raise UsageError(f"model {self.name!r}: activation precision {self.activation_precision!r}",
                             f"use one of {PRECISIONS}")
        if not 0 < self.checkpoint_fraction <= 1:
            raise UsageError(f"model {self.name!r}: checkpoint fraction {self.checkpoint_fraction!r}",
                             "give the fraction of activations kept under checkpointing, in (0, 1]")

    @property
    def trainable(self) -> int:
        """Parameters with gradients and optimizer state: all, unless fine-tuning says fewer."""
        return self.params if self.trainable_params is None else self.trainable_params

    @property
    def frozen(self) -> int:
        return self.params - self.trainable


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One device running one model at one precision."""

    device: str                              # label, e.g. 'cuda:0 NVIDIA A100…'
    source: str                              # 'measured …', 'catalog: …' — how, for people
    overhead_s: float                        # a: seconds per micro-batch regardless of its size
    per_sample_s: float                      # b: seconds per sample
    fixed_bytes: int                         # parameters + gradients + optimizer state
    activation_bytes_per_sample: float       # d: activation bytes per sample (no checkpointing)
    activation_fixed_bytes: float = 0.0      # c: per micro-batch, whatever its size (e.g. autocast weight copies)
    optimizer_s: float = 0.0                 # one optimizer step (clip, update) per global step
    memory_bytes: int | None = None          # device memory or its cap; None: not limited
    precision: str = "fp32"
    checkpoint_fraction: float = 0.25        # activations kept under activation checkpointing
    recompute_factor: float = 4 / 3          # compute multiplier under checkpointing (one more forward)
    blocks: int | None = None                # repeated blocks checkpointing can wrap one by one (None: all or none)
    cpu_share: float = 0.0                   # fraction of its compute time that occupies a host core
    forward_fraction: float = 1 / 3          # of a micro-batch's compute, the forward (backward ≈ 2×)
    paced_cost: float = 1.0                  # a micro-batch paced (a sleep before its backward)
                                             # over one flat out, measured; 1.0: not paced
    gpu: str | None = None                   # catalog key, when known
    link_gbs: float | None = None            # this device's link to its peers (GB/s), when known
    sizes: tuple[int, ...] = ()              # the micro-batch sizes measured…
    seconds: tuple[float, ...] = ()          # …and their seconds (what the fit came from)
    # What this device shares with the others that the cost model must play out (cost.py): an
    # object with the methods cost.step_cost and the ranking call (SharedHost, for CPU threads
    # of one host playing GPUs). None: devices that compute independently. Set
    # where the profiles are planned from, never saved with them.
    host: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        fix = "re-measure (delete the profile cache) or check the numbers given"
        _non_negative(f"{self.device}: overhead seconds", self.overhead_s, fix)
        _positive(f"{self.device}: seconds per sample", self.per_sample_s, fix)
        _non_negative(f"{self.device}: fixed bytes", self.fixed_bytes, fix)
        _non_negative(f"{self.device}: activation bytes per sample", self.activation_bytes_per_sample, fix)
        _non_negative(f"{self.device}: activation fixed bytes", self.activation_fixed_bytes, fix)
        _non_negative(f"{self.device}: optimizer seconds", self.optimizer_s, fix)
        if self.memory_bytes is not None:
            _positive(f"{self.device}: memory", self.memory_bytes, "give a positive memory size, e.g. 24GiB")
        if self.precision not in PRECISIONS:
            raise UsageError(f"{self.device}: precision {self.precision!r}", f"use one of {PRECISIONS}")
        if not 0 < self.checkpoint_fraction <= 1 or not self.recompute_factor >= 1:
            raise UsageError(f"{self.device}: checkpoint fraction {self.checkpoint_fraction} / recompute "
                             f"factor {self.recompute_factor}", "use a fraction in (0, 1] and a factor >= 1")
        if self.blocks is not None and (not isinstance(self.blocks, int) or self.blocks < 1):
            raise UsageError(f"{self.device}: blocks {self.blocks!r}", "give the model's repeated blocks, >= 1, or none")
        if not 0 < self.forward_fraction < 1:
            raise UsageError(f"{self.device}: forward fraction {self.forward_fraction}", "use a fraction in (0, 1)")
        if not 1 <= self.paced_cost <= 2:
            raise UsageError(f"{self.device}: paced cost {self.paced_cost}", "use a ratio in [1, 2]")
        if not 0 <= self.cpu_share <= 1:
            raise UsageError(f"{self.device}: cpu share {self.cpu_share}", "use a fraction in [0, 1]")
        if len(self.sizes) != len(self.seconds):
            raise UsageError(f"{self.device}: {len(self.sizes)} sizes but {len(self.seconds)} timings", fix)

    # -- activation checkpointing of k of the N blocks -----------------------------------------
    # Each checkpointed block gives up 1/N of the saving checkpointing every block makes, and
    # costs 1/N of its recompute. Against the exact count of the first k blocks checkpointed
    # (outside + k·input + (N−k)·inside: memory.activation_bytes_per_sample) this keeps k/N of one
    # block's inside more: cautious, exact at k = 0 and k = N. `blocks` None: every block.
    def _k(self, checkpointing: bool, blocks: int | None) -> float:
        """The fraction of the blocks checkpointed."""
        if not checkpointing:
            return 0.0
        if blocks is None or self.blocks is None:
            return 1.0
        return min(max(blocks, 0), self.blocks) / self.blocks

    def keep_fraction(self, *, checkpointing: bool, blocks: int | None = None) -> float:
        """Activations kept with `blocks` of the model's blocks checkpointed (None: all of them)."""
        return 1.0 - self._k(checkpointing, blocks) * (1.0 - self.checkpoint_fraction)

    def recompute(self, *, checkpointing: bool, blocks: int | None = None) -> float:
        """Compute multiplier with `blocks` of the blocks checkpointed (None: all of them)."""
        return 1.0 + self._k(checkpointing, blocks) * (self.recompute_factor - 1.0)

    # -- time ---------------------------------------------------------------------------------
    def micro_seconds(self, m: int, *, checkpointing: bool = False, blocks: int | None = None) -> float:
        """Seconds for one micro-batch of m samples (forward + backward)."""
        return (self.overhead_s + self.per_sample_s * m) * self.recompute(checkpointing=checkpointing, blocks=blocks)

    def samples_per_s(self, m: int, *, checkpointing: bool = False, blocks: int | None = None) -> float:
        return m / self.micro_seconds(m, checkpointing=checkpointing, blocks=blocks)

    # -- memory -------------------------------------------------------------------------------
    def memory_needed(self, m: int, *, checkpointing: bool = False, blocks: int | None = None) -> float:
        """Peak bytes with micro-batches of m samples: model state plus one micro-batch's activations."""
        act = self.activation_fixed_bytes + self.activation_bytes_per_sample * m
        return self.fixed_bytes + act * self.keep_fraction(checkpointing=checkpointing, blocks=blocks)

    def max_micro_batch(self, *, margin: float, checkpointing: bool = False, blocks: int | None = None) -> int | None:
        """Largest micro-batch that fits with `margin` of the memory kept free; None: unlimited,
        0: not even one sample fits."""
        if self.memory_bytes is None:
            return None
        usable = self.memory_bytes * (1 - margin) - self.fixed_bytes
        keep = self.keep_fraction(checkpointing=checkpointing, blocks=blocks)
        usable -= self.activation_fixed_bytes * keep
        per_sample = self.activation_bytes_per_sample * keep
        if usable < per_sample or usable <= 0:
            return 0
        if per_sample <= 0:
            return None
        return int(usable // per_sample)

    def fewest_blocks(self, *, margin: float, micro: int = 1) -> tuple[bool, int | None] | None:
        """(checkpointing, blocks) with the fewest checkpointed blocks that let a micro-batch of
        `micro` samples fit: (False, None) without; (True, k) for k of the blocks; (True, None) for
        every block (all of them needed, or the block count unknown); None: not even with every
        block (for `micro` > 1: every block, if one sample fits with it)."""
        def reaches(cap: int | None) -> bool:
            return cap is None or cap >= micro

        if reaches(self.max_micro_batch(margin=margin)):
            return False, None
        if not reaches(self.max_micro_batch(margin=margin, checkpointing=True)):
            return (True, None) if micro > 1 and self.max_micro_batch(margin=margin, checkpointing=True) else None
        if self.blocks is None:
            return True, None
        lo, hi = 1, self.blocks          # memory falls as k grows: the first k that fits, by bisection
        while lo < hi:
            mid = (lo + hi) // 2
            if reaches(self.max_micro_batch(margin=margin, checkpointing=True, blocks=mid)):
                hi = mid
            else:
                lo = mid + 1
        return True, (None if lo == self.blocks else lo)

    # -- transforms ---------------------------------------------------------------------------
    def scaled(self, factor: float, *, source: str | None = None, **changes) -> DeviceProfile:
        """The same device `factor` times slower (all compute times multiplied)."""
        return replace(self, overhead_s=self.overhead_s * factor, per_sample_s=self.per_sample_s * factor,
                               optimizer_s=self.optimizer_s * factor,
                               seconds=tuple(s * factor for s in self.seconds),
                               source=source or self.source, **changes)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = asdict(replace(self, host=None))
        del out["host"]
        return {"schema": PROFILE_SCHEMA, **out}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> DeviceProfile:
        data = dict(data)
        schema = data.pop("schema", None)
        if schema != PROFILE_SCHEMA:
            raise ValueError(f"profile schema {schema} is not {PROFILE_SCHEMA}: re-measure")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile fields {sorted(unknown)}")
        data["sizes"] = tuple(int(s) for s in data.get("sizes", ()))
        data["seconds"] = tuple(float(s) for s in data.get("seconds", ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> DeviceProfile:
        return cls.from_dict(json.loads(text))


def fit_linear(sizes: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Fit values ≈ a + b·size with a >= 0, b > 0, minimising Σ (a + b·s − v)² / v: between the
    absolute error (which would let the large sizes decide a alone) and the relative one (which
    would let a noisy 1-sample timing move b). One point: a = 0."""
    if len(sizes) != len(values) or not sizes:
        raise ValueError("need as many values as sizes, at least one")
    if len(set(sizes)) == 1:
        b = sum(v / s for s, v in zip(sizes, values)) / len(sizes)
        return 0.0, max(b, 1e-12)
    w = [1.0 / max(v, 1e-12) for v in values]
    sw = sum(w)
    sx = sum(wi * s for wi, s in zip(w, sizes))
    sy = sum(wi * v for wi, v in zip(w, values))
    sxx = sum(wi * s * s for wi, s in zip(w, sizes))
    sxy = sum(wi * s * v for wi, s, v in zip(w, sizes, values))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if a < 0 or b <= 0:      # fall back to a line through the origin: values ∝ size
        a = 0.0
        b = sxy / sxx
    return a, max(b, 1e-12)
