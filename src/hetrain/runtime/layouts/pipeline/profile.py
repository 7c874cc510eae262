"""A model's blocks as the pipeline planner costs them (pure; no torch): each part's seconds,
activation and parameter bytes per sample (runtime/layouts/pipeline/blocks.profile_blocks measures them),
and how a stage runs them on its device and host (runtime/layouts/pipeline/probe.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ....errors import UsageError


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """One part of the model, per sample, at speed 1.0."""

    seconds: float                 # forward + backward, per sample
    activation_bytes: float = 0.0  # kept from forward to backward, per sample
    param_bytes: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        for what in ("seconds", "activation_bytes", "param_bytes"):
            value = getattr(self, what)
            if not (value >= 0 and math.isfinite(value)):
                raise UsageError(f"block {self.name or '?'}: {what}={value!r} must be a finite number >= 0",
                                 "profile the model again, or give non-negative costs")


@dataclass(frozen=True, kw_only=True)
class PipelineProfile:
    """Costs of a model's blocks (and its first/last parts), e.g. from `runtime/layouts/pipeline/blocks.profile_blocks`."""

    blocks: tuple[BlockCost, ...]
    first: BlockCost | None = None     # runs before the blocks, on the first stage
    last: BlockCost | None = None      # runs after the blocks, on the last stage
    boundary_bytes: float = 0.0        # activation bytes per sample sent from one stage to the next
    tied_param_bytes: float = 0.0      # parameters the first and last parts share (held twice)
    # How a stage runs a block of profiled time s: a micro-batch of µ rows takes block_s + f·µ·s
    # (measured by runtime/layouts/pipeline/probe.py; 1 and 0: not measured).
    stage_factor: float = 1.0
    block_s: float = 0.0
    first_s: float = 0.0               # ... and what the first / last part adds a micro-batch on its stage
    last_s: float = 0.0                # (the last's with the loss, a piece of its own)
    # What the stages' shared host adds to a step, as the probe measured it where they share one
    # (StageHooks.probe_host: named figures, seconds or ratios; None: each stage computes on its
    # own device). Read by what plays the step out on that host (DeviceProfile.host's pipeline).
    host: dict | None = field(default=None, hash=False)
    source: str = "given"              # e.g. 'measured on rank 0 (speed 1.0), 4 samples'

    def __post_init__(self) -> None:
        if not self.blocks:
            raise UsageError("the model has no blocks to split into stages",
                             "give a model with a list of blocks (nn.Sequential, ModuleList, or PipelineParts)")
        if not (self.stage_factor > 0 and math.isfinite(self.stage_factor)):
            raise UsageError(f"stage_factor={self.stage_factor!r} must be a finite number > 0",
                             "measure the pipeline again, or give a positive factor (1: the blocks' own time)")
        if not (self.block_s >= 0 and math.isfinite(self.block_s)):
            raise UsageError(f"block_s={self.block_s!r} must be a finite number >= 0",
                             "measure the pipeline again, or give seconds >= 0 a block per micro-batch")
        if not (self.first_s >= 0 and self.last_s >= 0 and math.isfinite(self.first_s + self.last_s)):
            raise UsageError(f"first_s={self.first_s!r}, last_s={self.last_s!r} must be finite numbers >= 0",
                             "measure the pipeline again, or give seconds >= 0 a micro-batch")
        if self.host is not None and not all(isinstance(v, (int, float)) and 0 <= v < math.inf
                                             for v in self.host.values()):
            raise UsageError(f"the stages' host figures {self.host!r}",
                             "measure the pipeline again, or give finite numbers >= 0")

    def stage_seconds(self, start: int, stop: int, *, first: bool, last: bool) -> float:
        """Per sample at speed 1: blocks [start, stop), with the first/last part on the first/last stage."""
        parts = [*self.blocks[start:stop], *([self.first] if first else []), *([self.last] if last else [])]
        return sum(p.seconds for p in parts if p is not None)

    def on_clock(self, sample_s: float) -> PipelineProfile:
        """These blocks on a clock that gives a device's time (StageHooks.as_run): the whole
        model's forward and backward last `sample_s` a sample at speed 1, shared among the parts as
        measured, and a stage runs them in exactly that (stage_factor 1, block_s 0): a stage's
        piece lasts its rows' share of the clock (StageHooks.micro_batch_s), whatever it took."""
        total = self.stage_seconds(0, len(self.blocks), first=True, last=True)
        if not sample_s > 0 or not total > 0:
            raise UsageError(f"the controlled clock's {sample_s!r} s a sample over blocks of {total!r} s",
                             "give a positive clock, and blocks with a measured time")
        scale = sample_s / total

        def scaled(part: BlockCost | None) -> BlockCost | None:
            return None if part is None else replace(part, seconds=part.seconds * scale)

        return replace(self, blocks=tuple(scaled(b) for b in self.blocks), first=scaled(self.first),
                       last=scaled(self.last), stage_factor=1.0, block_s=0.0, first_s=0.0, last_s=0.0,
                       source=f"{self.source}; on the controlled clock: {sample_s * 1e3:g} ms a sample at speed 1")

    @classmethod
    def uniform(cls, *, n_blocks: int, seconds_per_sample: float, activation_bytes_per_sample: float,
                param_bytes: float, boundary_bytes: float = 0.0, source: str = "whole-model profile / blocks"
                ) -> PipelineProfile:
        """Equal blocks from a whole-model profile (e.g. the planner's per-sample time and memory),
        for comparing layouts before any block is measured."""
        if n_blocks < 1:
            raise UsageError(f"n_blocks={n_blocks}", "give the number of blocks the model stacks (>= 1)")
        block = BlockCost(seconds=seconds_per_sample / n_blocks,
                          activation_bytes=activation_bytes_per_sample / n_blocks, param_bytes=param_bytes / n_blocks)
        return cls(blocks=(block,) * n_blocks, boundary_bytes=boundary_bytes, source=source)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PipelineProfile:
        """The profile `to_dict` wrote (JSON: `hetrain plan`'s measured blocks)."""
        part = lambda d: None if d is None else BlockCost(**d)      # noqa: E731
        return cls(**{**data, "blocks": tuple(BlockCost(**b) for b in data["blocks"]),
                      "first": part(data.get("first")), "last": part(data.get("last"))})

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def parts(self) -> tuple[BlockCost, ...]:
        return tuple(p for p in (self.first, *self.blocks, self.last) if p is not None)

    @property
    def seconds_per_sample(self) -> float:
        return sum(p.seconds for p in self.parts())

    @property
    def param_bytes(self) -> float:
        """Parameter bytes of the whole model (the tied weight counted once)."""
        return sum(p.param_bytes for p in self.parts()) - self.tied_param_bytes

    @property
    def activation_bytes_per_sample(self) -> float:
        return sum(p.activation_bytes for p in self.parts())
