"""What a pipeline split predicts (pure; no torch): each stage's blocks, time per micro-batch and
memory, and the pipeline's step time under a fill-drain schedule. Made by runtime/layouts/pipeline/split.py
(which says how the numbers are computed) and re-exported there."""

from __future__ import annotations

from dataclasses import dataclass

from ....errors import UsageError
from ....hardware.units import format_bytes as _gib

_EPS = 1e-12


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    device: str
    speed: float
    start: int                         # first block (inclusive)
    stop: int                          # last block (exclusive)
    seconds_per_micro: float           # compute + send of one micro-batch, forward + backward
    in_flight: int                     # micro-batches whose activations this stage holds at once
    param_bytes: float                 # its parameters (as many gradient bytes to all-reduce, DP×PP)
    state_bytes: float                 # parameters + gradients + optimizer state
    activation_bytes: float            # in_flight micro-batches of activations (+ received inputs)
    memory_cap: float | None           # usable bytes (device memory less the margin); None: unlimited

    @property
    def n_blocks(self) -> int:
        return self.stop - self.start

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.memory_cap is None or self.memory_bytes <= self.memory_cap


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """A partition of the blocks into stages, with what it predicts."""

    stages: tuple[StagePlan, ...]
    schedule: str
    micro_batches: int
    micro_batch_size: int
    reasons: tuple[str, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        """Blocks per stage, e.g. (8, 4)."""
        return tuple(s.n_blocks for s in self.stages)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.start, s.stop) for s in self.stages)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.n_stages, self.micro_batches)

    @property
    def bottleneck(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.seconds_per_micro)

    @property
    def step_seconds(self) -> float:
        """Fill-drain estimate: Σ_s t_s + (m − 1)·max_s t_s."""
        return fill_drain_seconds([s.seconds_per_micro for s in self.stages], self.micro_batches)

    @property
    def samples_per_s(self) -> float:
        return self.micro_batches * self.micro_batch_size / max(self.step_seconds, _EPS)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def describe(self) -> list[str]:
        """One line per stage, for people."""
        lines = []
        for s in self.stages:
            cap = f" of {_gib(s.memory_cap)}" if s.memory_cap is not None else ""
            lines.append(f"stage {s.index} on {s.device} (speed {s.speed:.3g}): blocks {s.start}-{s.stop - 1} "
                         f"({s.n_blocks}), {s.seconds_per_micro * 1e3:.3g} ms/micro-batch, "
                         f"{s.in_flight} in flight, {_gib(s.memory_bytes)}{cap}")
        return lines


def fill_drain_seconds(stage_seconds, micro_batches: int) -> float:
    """A fill-drain pipeline's step: Σ_s t_s + (m − 1)·max_s t_s for stages of t_s a micro-batch."""
    return sum(stage_seconds) + (micro_batches - 1) * max(stage_seconds)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """(p − 1)/(m + p − 1): the idle share of a pipeline of p equal stages over m micro-batches."""
    if stages < 1 or micro_batches < 1:
        raise UsageError(f"{stages} stages and {micro_batches} micro-batches", "use at least one of each")
    return (stages - 1) / (micro_batches + stages - 1)
