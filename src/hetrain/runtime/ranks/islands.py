"""The job's device islands and their groups: one group per island on its native backend, and a
bridge over gloo on host memory.

Vendor collective libraries do not talk to each other (an NCCL and an RCCL rank in one ring fail),
so a job whose ranks span islands runs each island's collectives on that island's own library and
joins the islands over gloo, on host copies of the tensors. Ranks whose tensors are host tensors
(a cluster spec's cards computing on the host CPU) run every group on gloo (`Islands.backends`,
from the islands found at start), and where the spec's links are modelled (`Islands.link`) each
island's group runs through its island's link and the bridge through the bridge's (attached by
runtime/sharding/island_hooks.py attach_links).

The bridge groups. Not one group of all ranks: across islands only matching pieces travel, and a
ring over all W ranks would price and carry what the hierarchical all-reduce never sends. The
bridge is the ring of the islands' k representatives, 2(k-1)/k · S / B_bridge for S bytes:
  * islands of equal size n: n bridge groups, the j-th of them joins the j-th rank of every island,
    each carrying the 1/n shard that rank holds after its island's reduce-scatter (the sharded
    form: the bridge carries S in all, spread over n host links);
  * islands of different sizes: one bridge group of the islands' leaders (their lowest ranks),
    which carries the whole S (leaders' form: reduce to the leader, bridge, broadcast back).
The first bridge group is always the leaders'.

The host-staging rule: every collective on a bridge group goes through `bridge_all_reduce`, which
copies a device tensor to host memory (pinned on CUDA, so the copy is a DMA), runs gloo there and
copies the result back. tests/unit/runtime/ranks/test_island_groups.py checks that no other
code hands a bridge group to a collective. A pipeline across islands (`pipeline_groups`) sends its
activations and gradients over a gloo group through `staged_p2p`, the same staging for P2P.

Which island a rank is on: a cluster spec's device's `island` (hardware/cluster.py ClusterDevice,
from the island spec), or what its device is (vendor and device type); the job-wide layout is the
one every rank gathered at start (runtime/ranks/nodes.py join_nodes), so no collective here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist



@dataclass(frozen=True)
class Islands:
    """Which island every rank is on, each island's native backend and link, and the bridge."""

    island_of: tuple[str, ...]                      # per rank
    backends: dict = field(default_factory=dict)    # island -> its groups' backend (nccl|hccl|xccl|gloo)
    links_gbs: dict = field(default_factory=dict)   # island -> its own link's GB/s, where a spec names one
    bridge_gbs: float | None = None                 # the bridge's GB/s, where a spec names it
    # link(gbs, ring) -> what runs a collective over a link of those figures (JobIslands.link); None: the wire
    link: object = None

    def __post_init__(self):
        if not self.island_of or any(not name for name in self.island_of):
            raise ValueError(f"every rank needs an island name: {self.island_of!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The islands, in the order of their lowest rank."""
        return tuple(dict.fromkeys(self.island_of))

    @property
    def world_size(self) -> int:
        return len(self.island_of)

    @property
    def spans(self) -> bool:
        return len(self.names) > 1

    def members(self, name: str) -> tuple[int, ...]:
        return tuple(r for r, i in enumerate(self.island_of) if i == name)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(self.members(n)) for n in self.names)

    @property
    def sharded(self) -> bool:
        """Equal islands: the bridge carries shards (else the leaders carry the whole gradient)."""
        return len(set(self.sizes)) == 1

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(self.members(n)[0] for n in self.names)

    def bridge_ranks(self) -> tuple[tuple[int, ...], ...]:
        """The bridge groups' ranks: the j-th rank of every island for each shard j (sharded), or
        the leaders alone."""
        count = self.sizes[0] if self.sharded else 1
        return tuple(tuple(self.members(n)[j] for n in self.names) for j in range(count))

    def describe(self) -> str:
        parts = [f"{n} ({len(self.members(n))} rank(s) {','.join(map(str, self.members(n)))}, "
                 f"{self.backends.get(n, 'gloo')})" for n in self.names]
        form = (f"sharded: {self.sizes[0]} bridge ring(s) of {len(self.names)}" if self.sharded
                else f"leaders {','.join(map(str, self.leaders))} over the bridge")
        return f"islands {'; '.join(parts)}; bridge gloo on host memory, {form}"


@dataclass
class IslandGroups:
    """This rank's groups: its island's, and the bridge group it is on (None: a non-leader in the
    leaders' form), each with the modelled link its collectives run through, where there is one."""

    islands: Islands
    rank: int
    native: object                    # a ProcessGroup: this rank's island
    native_ranks: tuple[int, ...]
    bridge: object | None             # a gloo ProcessGroup, or None: this rank does not cross
    bridge_ranks: tuple[int, ...]
    native_link: object | None = None   # Islands.link's, for the island's group; None: the wire
    bridge_link: object | None = None   # ... for the bridge group
    bridged_bytes: float = 0.0        # what this rank sent over the bridge, in all

    @property
    def index(self) -> int:
        """This rank's place in its island."""
        return self.native_ranks.index(self.rank)

    @property
    def leader(self) -> int:
        return self.native_ranks[0]


def make_groups(islands: Islands, *, rank: int, timeout=None) -> IslandGroups:
    """Every group of the job (a collective: every rank makes every group, in the same order, as
    new_group requires), each island's on its backend (`Islands.backends`: gloo where the ranks
    hold host tensors); the modelled links are attached above this layer (runtime/sharding/
    island_hooks.py attach_links). `timeout`: the job's collective timeout (a timedelta; None:
    torch's default, 30 minutes for a hung peer)."""
    extra = {} if timeout is None else {"timeout": timeout}
    native = bridge = None
    native_ranks: tuple[int, ...] = ()
    bridge_ranks: tuple[int, ...] = ()
    for name in islands.names:
        ranks = islands.members(name)
        group = dist.new_group(list(ranks), backend=islands.backends.get(name, "gloo"), **extra)
        if rank in ranks:
            native, native_ranks = group, ranks
    for ranks in islands.bridge_ranks():
        group = dist.new_group(list(ranks), backend="gloo", **extra)
        if rank in ranks:
            bridge, bridge_ranks = group, ranks
    return IslandGroups(islands, rank, native, native_ranks, bridge, bridge_ranks)


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like `tensor`, pinned when it is to hold a CUDA one (a DMA copy)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.device.type == "cuda")


def bridge_all_reduce(tensor: torch.Tensor, groups: IslandGroups) -> torch.Tensor:
    """Sum `tensor` over this rank's bridge group, in place: the one way onto the bridge. A device
    tensor is staged through host memory (gloo on host memory works between any vendors' builds)."""
    if groups.bridge is None:
        raise RuntimeError(f"rank {groups.rank} is on no bridge group ({groups.islands.describe()})")
    staged = tensor.device.type != "cpu"
    host = _host_buffer(tensor) if staged else tensor
    if staged:
        host.copy_(tensor, non_blocking=True)
        if tensor.device.type == "cuda":      # gloo reads the host copy: it must have landed
            torch.cuda.current_stream(tensor.device).synchronize()
    assert host.device.type == "cpu", "the bridge takes host tensors only"
    nbytes = float(host.numel() * host.element_size())
    if groups.bridge_link is None:
        dist.all_reduce(host, group=groups.bridge)
    else:
        groups.bridge_link.run(lambda: dist.all_reduce(host, group=groups.bridge), nbytes)
    groups.bridged_bytes += nbytes
    if staged:
        tensor.copy_(host)
    return tensor


def native_run(groups: IslandGroups, collective, nbytes: float) -> None:
    """A blocking collective on the island's group, through the island's modelled link if any."""
    if groups.native_link is None:
        collective()
    else:
        groups.native_link.run(collective, nbytes)


def for_job(job) -> Islands | None:
    """The job's islands, or None when it is one island: those every rank's device put in the job's
    nodes at start (nodes.join_nodes, gathered there already, so no collective here), each island's
    groups on the backend its ranks' tensors need, with the links' figures a cluster spec gives."""
    found = getattr(job.nodes, "islands", None)
    if found is None or not found.multi or job.world_size < 2:
        return None
    return Islands(island_of=tuple(found.island_of(r).name for r in range(job.world_size)),
                   backends={i.name: i.group_backend or i.backend for i in found.islands},
                   links_gbs=dict(found.links_gbs), bridge_gbs=found.bridge_gbs, link=found.link)


def spec_links(cluster) -> tuple[float | None, dict]:
    """(the bridge's GB/s, {island: its own link's GB/s}) of a ClusterSpec: the topology's bridge,
    and for each island the link of the node its devices are on, where the spec names one."""
    topology = cluster.topology
    bridge = topology.bridge.bandwidth_gbs if topology.bridge is not None else None
    links: dict = {}
    for device in cluster.devices:
        link = topology.node_of(device.index).link
        if device.island and link is not None:
            links.setdefault(device.island, link.bandwidth_gbs)
    return bridge, links


def pipeline_groups(islands: Islands, grid, *, rank: int, timeout) -> tuple:
    """(this rank's pipeline group, its data-parallel group) of a DP×PP mesh (`grid`: a row per
    replica, its stages' ranks) over islands, as the research practice runs it: the replicas of a
    stage (a column) on one island, summing their gradients on its native backend; a replica's
    pipeline (a row) across islands over gloo, the bridge. A collective: every rank makes every
    group, in the same order. A column that spans islands is refused: its gradient sum would have
    to cross the bridge every step (data parallel across islands: parallel='dp'). Each stage's
    group runs on its island's backend (`Islands.backends`)."""
    from ...errors import UsageError

    for s in range(len(grid[0])):
        column = [row[s] for row in grid]
        names = sorted({islands.island_of[r] for r in column})
        if len(names) > 1:
            raise UsageError(
                f"DP×PP across islands: stage {s}'s replicas (ranks {', '.join(map(str, column))}) are on islands "
                f"{', '.join(names)}, so their gradient sum would cross the bridge every step",
                "order the ranks so that stage s of every replica is on one island (rank = replica × stages "
                "+ stage: e.g. islands nv,amd,nv,amd for 2 stages), or use parallel='dp' across islands")
    mine = {}
    for ranks in grid:
        crosses = len({islands.island_of[r] for r in ranks}) > 1
        backend = "gloo" if crosses else islands.backends.get(islands.island_of[ranks[0]], "gloo")
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if rank in ranks:
            mine["pp"] = group
    for s in range(len(grid[0])):
        ranks = [row[s] for row in grid]
        backend = islands.backends.get(islands.island_of[ranks[0]], "gloo")
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine["dp"] = group
    return mine["pp"], mine["dp"]


def _needs_staging(tensor: torch.Tensor, group) -> bool:
    """A device tensor sent or received over a gloo group (the bridge between islands)."""
    return tensor.device.type != "cpu" and "gloo" in str(dist.get_backend(group))


def staged_p2p(ops: list, landing: list) -> list:
    """A pipeline's sends and receives (torch's P2POps) as the bridge carries them: a device tensor
    on a gloo group goes through a host copy (pinned on CUDA). A send's copy is made now; a
    receive lands in a host buffer, and (host, device tensor) is appended to `landing`, for `land`
    once the receive has completed. Other ops are left as they are."""
    out = []
    for op in ops:
        tensor = op.tensor
        if not _needs_staging(tensor, op.group):
            out.append(op)
            continue
        host = _host_buffer(tensor)
        if op.op in (dist.isend, dist.send):
            host.copy_(tensor, non_blocking=True)
            if tensor.device.type == "cuda":      # gloo reads the host copy: it must have landed
                torch.cuda.current_stream(tensor.device).synchronize()
        else:
            landing.append((host, tensor))
        out.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
    return out


def land(landing: list) -> None:
    """The staged receives, completed, copied into the device tensors the stage reads (receive
    buffers of activations are leaves that require grad: filled as data, outside autograd)."""
    with torch.no_grad():
        for host, tensor in landing:
            tensor.copy_(host)
    landing.clear()
