"""What the host bridge between device islands costs (pure): staging over each card's PCIe, the
bridge link, and the collectives and sends that cross it.

Vendor collective libraries do not talk to each other, so islands of different vendors (or the
CPU) are joined through host memory: a tensor leaves its card over the card's PCIe (device to
host, D2H), crosses the bridge (gloo over the host network, `Topology.bridge`), and enters the
other island's cards over theirs (host to device, H2D). With S bytes of gradient, k islands of
n_i devices on their own links L_i and a bridge B:

    hierarchical all-reduce (the islands' native library inside, the bridge between them)
        = max_i RS(n_i, S, L_i)          reduce-scatter inside each island: a shard of S/n_i each
        + max_i (S/n_i) / P_i            each rank stages its shard D2H over its PCIe P_i
        + AR(k, S, B)                    the shards all-reduced across islands; an island's shards
                                         together carry S through its bridge link however cut
        + max_i (S/n_i) / P_i            H2D
        + max_i AG(n_i, S, L_i)          all-gather inside each island
    Islands of different sizes cut different shards; the runtime then reduces to one leader per
    island (`leaders`), which stages the whole S over one PCIe.

    flat all-reduce (one gloo ring over every rank, through host memory)
        = S / P_min  +  AR(W, S, B)  +  S / P_min      every rank stages the whole gradient

    a pipeline boundary (activations forward, their gradients back)
        = m / P_send + m / B + α_B + m / P_recv

RS, AG, AR and the send are collectives.py's ring formulas. A device whose tensors already live in
host memory (the CPU, a card computing on the host CPU) stages nothing (`host_gbs` inf). The same host link
prices the CPU's other role, holding offloaded optimizer state (`offload_step_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..hardware.catalog import GpuSpec
from ..hardware.links import PCIE_GBS, LinkSpec
from .collectives import Link, all_gather_seconds, allreduce_seconds, reduce_scatter_seconds

ON_HOST = math.inf          # a device whose tensors are in host memory: nothing to stage


def on_host(gpu: GpuSpec) -> bool:
    return gpu.device_type == "cpu" or gpu.vendor == "cpu"


def host_gbs(gpu: GpuSpec, *, host_tensors: bool = False) -> float:
    """GB/s between this device and host memory: its catalog PCIe generation's effective x16
    figure (hardware/links.py), ON_HOST for the CPU and for a device whose tensors are host tensors
    whatever card it stands for (`host_tensors`: it computes on the host CPU)."""
    if host_tensors or on_host(gpu):
        return ON_HOST
    return PCIE_GBS.get(gpu.pcie_gen, PCIE_GBS[4])


def to_link(spec: LinkSpec) -> Link:
    return Link(bandwidth_gbs=spec.bandwidth_gbs, latency_s=spec.latency_s, source=spec.source)


def stage_seconds(nbytes: float, gbs: float) -> float:
    """One copy of `nbytes` between a device and host memory (0 for a device on the host)."""
    return 0.0 if not math.isfinite(gbs) or nbytes <= 0 else nbytes / (gbs * 1e9)


@dataclass(frozen=True, kw_only=True)
class Island:
    """One device island as the cost model sees it: its devices (indices into the job's devices),
    the link inside it and each device's host link."""

    name: str
    devices: tuple[int, ...]
    link: Link
    host_gbs: tuple[float, ...]        # per device, GB/s to host memory (ON_HOST: nothing to stage)
    vendor: str = "nvidia"

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def slowest_host_gbs(self) -> float:
        return min(self.host_gbs)

    @property
    def is_cpu(self) -> bool:
        return self.vendor == "cpu"


@dataclass(frozen=True, kw_only=True)
class BridgeAllReduce:
    """One all-reduce of the gradient across islands, phase by phase (seconds)."""

    within_s: float          # reduce-scatter and all-gather inside the islands (the native links)
    staging_s: float         # device to host and back over PCIe
    bridge_s: float          # across the bridge
    leaders: bool = False    # islands of different sizes: one leader per island stages the whole S

    @property
    def total_s(self) -> float:
        return self.within_s + self.staging_s + self.bridge_s

    @property
    def crossing_s(self) -> float:
        """What joining the islands adds: the staging and the bridge."""
        return self.staging_s + self.bridge_s


def hierarchical_allreduce(islands: Sequence[Island], nbytes: float, bridge: Link, *,
                           leaders: bool | None = None, bridge_links: int = 1) -> BridgeAllReduce:
    """The hierarchical all-reduce of `nbytes` over `islands` (module docstring). `leaders`: None
    picks what the runtime does (leaders when island sizes differ). `bridge_links`: host links of
    the bridge's bandwidth each island has (1: one NIC, which all its shards cross; n: a link per
    rank, each shard on its own, as multi-NIC hosts run it); the leaders' form uses one."""
    if not islands:
        raise ValueError("no islands")
    if leaders is None:
        leaders = len({i.size for i in islands}) > 1
    if len(islands) == 1:
        only = islands[0]
        return BridgeAllReduce(within_s=allreduce_seconds(only.size, nbytes, only.link), staging_s=0.0, bridge_s=0.0)
    if leaders:      # reduce to a leader (≈ a reduce-scatter's traffic), broadcast back (≈ an all-gather's)
        shard = [nbytes] * len(islands)
    else:
        shard = [nbytes / i.size for i in islands]
    rs = max(reduce_scatter_seconds(i.size, nbytes, i.link) for i in islands)
    ag = max(all_gather_seconds(i.size, nbytes, i.link) for i in islands)
    one_way = max(stage_seconds(s, i.slowest_host_gbs) for s, i in zip(shard, islands))
    parallel = 1 if leaders else max(1, min(bridge_links, min(i.size for i in islands)))
    return BridgeAllReduce(within_s=rs + ag, staging_s=2 * one_way,
                           bridge_s=allreduce_seconds(len(islands), nbytes / parallel, bridge), leaders=leaders)


def flat_allreduce(islands: Sequence[Island], nbytes: float, bridge: Link) -> BridgeAllReduce:
    """One gloo ring over every rank of every island, through host memory: each rank stages the
    whole gradient, and the ring runs at the bridge's pace (its slowest link)."""
    world = sum(i.size for i in islands)
    one_way = max(stage_seconds(nbytes, i.slowest_host_gbs) for i in islands)
    if len(islands) == 1:     # one island: its own link is the ring's slowest
        return BridgeAllReduce(within_s=0.0, staging_s=2 * one_way,
                               bridge_s=allreduce_seconds(world, nbytes, islands[0].link))
    return BridgeAllReduce(within_s=0.0, staging_s=2 * one_way, bridge_s=allreduce_seconds(world, nbytes, bridge))


def boundary_seconds(nbytes: float, sender: Island, receiver: Island, bridge: Link) -> float:
    """One pipeline boundary crossing the bridge: `nbytes` staged D2H, sent, staged H2D."""
    return (stage_seconds(nbytes, sender.slowest_host_gbs) + nbytes / bridge.bytes_per_s + bridge.latency_s
            + stage_seconds(nbytes, receiver.slowest_host_gbs))


def offload_step_seconds(*, trainable: int, element_bytes: float, state_bytes_per_param: float,
                         gbs: float) -> float:
    """One device's optimizer step with its optimizer state held in host memory (ZeRO-Offload):
    its gradients D2H and its updated weights H2D at the training precision over its host link,
    then the host's step reading and writing the fp32 masters and state and reading the gradients
    at the host's memory bandwidth (planning/savers.py offload_seconds: the planner's own price)."""
    from .savers import offload_seconds

    return offload_seconds(trainable * element_bytes, gbs, trainable * (4 + state_bytes_per_param), trainable * 4)


def islands_of(devices: Sequence, links: dict[str, Link] | None = None, *, host_tensors: bool = False,
               link_of=None) -> tuple[Island, ...]:
    """The islands of a job's devices (hardware/cluster.py ClusterDevice records, `island` set),
    in order of first appearance. Each island's link: `links[name]` when given, else `link_of`
    (the island's cards -> Link; default the catalog's, cost.py catalog_link). `host_tensors`: the
    devices compute on the host CPU, so nothing is staged to host memory (host_gbs)."""
    from .cost import catalog_link

    link_of = link_of or catalog_link
    order: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        order.setdefault(d.island, []).append(i)
    out = []
    for name, members in order.items():
        gpus = [devices[i].gpu for i in members]
        link = (links or {}).get(name) or link_of(gpus)
        vendor = "cpu" if all(on_host(g) for g in gpus) else gpus[0].vendor
        out.append(Island(name=name or "island0", devices=tuple(members), link=link, vendor=vendor,
                          host_gbs=tuple(host_gbs(g, host_tensors=host_tensors) for g in gpus)))
    return tuple(out)
