"""Communication times over one link: ring collectives and point-to-point sends (pure).

A `Link` is the slowest link a transfer crosses: its effective bandwidth B and a latency α per
hop. For S bytes over n devices in a ring (NCCL's algorithm for large messages):

    reduce-scatter     (n−1)/n · S/B +  (n−1)·α
    all-gather         (n−1)/n · S/B +  (n−1)·α       S: the gathered size
    all-reduce        2(n−1)/n · S/B + 2(n−1)·α       a reduce-scatter, then an all-gather
    send                        S/B +        α       one hop

Every step of a ring moves one n-th of the data over every link at once, so the slowest link
sets the pace; one device needs no collective (0 s). Across nodes, an all-reduce is a ring inside
each node and one across them (`hierarchical_allreduce_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def hierarchical_allreduce_seconds(node_sizes: Sequence[int], nbytes: float, intra: Sequence[Link],
                                   inter: Link) -> float:
    """All-reduce of S bytes over several nodes, as NCCL's hierarchical algorithms run it: node k
    (n_k devices on its own link L_k) first reduce-scatters within its ring, so each of its devices
    holds S/n_k reduced over the node; the nodes then all-reduce those shards over the inter-node
    link, every node's shards together crossing its one network link; then each node all-gathers.
    Each phase waits for its slowest node (nodes step together), so with N nodes

        T = max_k RS(n_k, S, L_k) + AR(N, S, net) + max_k AG(n_k, S, L_k)
          = 2 · max_k [(n_k−1)/n_k · S/B_k + (n_k−1)·α_k]  +  2(N−1)/N · S/B_net + 2(N−1)·α_net

    One node is the flat ring (RS + AG = AR). Nodes of different sizes hold shards of different
    sizes; the middle term counts the S bytes every node sends through its network link, which is
    what limits it however the shards are cut."""
    if len(node_sizes) != len(intra) or not node_sizes:
        raise ValueError("one intra-node link per node")
    if sum(node_sizes) <= 1:
        return 0.0
    within = max(reduce_scatter_seconds(n, nbytes, link) for n, link in zip(node_sizes, intra))
    return 2 * within + allreduce_seconds(len(node_sizes), nbytes, inter)


def hierarchical_link(node_sizes: Sequence[int], nbytes: float, intra: Sequence[Link], inter: Link,
                      source: str) -> Link:
    """The one ring link over all the devices that takes as long as the hierarchical all-reduce of
    `nbytes` (latency folded in): what a planner that models one ring needs."""
    seconds = hierarchical_allreduce_seconds(node_sizes, nbytes, intra, inter)
    return link_from_measurement(sum(node_sizes), nbytes, seconds, source)
