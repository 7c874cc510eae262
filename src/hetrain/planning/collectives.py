"""Communication times over one link: ring collectives and point-to-point sends (pure).

A `Link` is the slowest link a transfer crosses: its effective bandwidth B and a latency α per
hop. For S bytes over n devices in a ring (NCCL's algorithm for large messages):

    reduce-scatter     (n−1)/n · S/B +  (n−1)·α
    all-gather         (n−1)/n · S/B +  (n−1)·α       S: the gathered size
    all-reduce        2(n−1)/n · S/B + 2(n−1)·α       a reduce-scatter, then an all-gather
    send                        S/B +        α       one hop

Every step of a ring moves one n-th of the data over every link at once, so the slowest link
sets the pace; one device needs no collective (0 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.links import RING_HOP_LATENCY_S


@dataclass(frozen=True, kw_only=True)
class Link:
    """The slowest link a transfer crosses (of a ring, or between two stages): effective bandwidth
    and per-hop latency."""

    bandwidth_gbs: float
    latency_s: float = RING_HOP_LATENCY_S
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_gbs > 0 or not self.latency_s >= 0:
            raise UsageError(f"link bandwidth {self.bandwidth_gbs} GB/s, latency {self.latency_s} s",
                             "give a positive bandwidth, e.g. --link-gbs 24")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9


FREE_LINK = Link(bandwidth_gbs=math.inf, latency_s=0.0, source="communication not modelled")


def allreduce_seconds(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce: 2(n−1)/n · S/B + 2(n−1)·α. A reduce-scatter (n−1 steps, each sending S/n
    over every link) and then an all-gather of the reduced pieces (n−1 more)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bytes_per_s + 2 * (n - 1) * link.latency_s


def reduce_scatter_seconds(n: int, nbytes: float, link: Link) -> float:
    """Ring reduce-scatter of S bytes (each device ends with S/n reduced): (n−1)/n · S/B + (n−1)·α.
    In each of n−1 steps every device sends one S/n piece to its neighbour and adds the one it gets."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def all_gather_seconds(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather to S bytes on every device (S/n from each): (n−1)/n · S/B + (n−1)·α.
    In each of n−1 steps every device forwards the S/n piece it received last."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s


def send_seconds(nbytes: float, link: Link) -> float:
    """One point-to-point transfer (pipeline stage to stage): S/B + α — the whole message, one hop."""
    return nbytes / link.bytes_per_s + link.latency_s


def link_from_measurement(n: int, nbytes: float, seconds: float, source: str) -> Link:
    """The bus bandwidth that explains one measured all-reduce of `nbytes` over n devices: the
    all-reduce formula solved for B, its latency folded in (α = 0)."""
    seconds = max(seconds, 1e-9)
    return Link(bandwidth_gbs=2 * (n - 1) / n * nbytes / seconds / 1e9 if n > 1 else math.inf,
                latency_s=0.0, source=source)
