"""The job's nodes: which rank runs on which machine, and the job's islands, gathered at start.

Under a multi-node launch (`hetrain run --nnodes N ...` on torchrun's c10d rendezvous) every node's
launcher knows only its own devices. torchrun numbers the nodes (GROUP_RANK, the node's rank in
this rendezvous round) and gives each node's processes consecutive ranks; nodes may run different
process counts (an A100 node beside a two-3090 node). `gather` is one all_gather_object, entered by
every rank in Engine.__init__, that gives every rank every rank's node, node name, device and
versions (and what the caller adds to a rank's record). From that table all ranks build the same
JobNodes and take the same decision on a node that does not fit the job (torch or NCCL versions
that differ: hardware/node_versions.py), so all raise the same error together. Where the ranks'
devices are a cluster spec's, the job's spec is made from the gathered records by the caller
(`join_nodes`' `cluster_of`: the nodes' specs joined in rank order, so speeds are scaled once for
the whole job, hardware/cluster.py), and the islands are that spec's.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from ..config import LAUNCH_ENV


@dataclass(frozen=True, kw_only=True)
class JobNodes:
    names: tuple[str, ...]                 # per node, in node order
    node_of: tuple[int, ...]               # per rank: its node's index into `names`
    islands: object = None                 # island_facts.JobIslands, found at start (join_nodes)

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def spans_nodes(self) -> bool:
        return self.count > 1

    def ranks_on(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of every node, in node order (the ranks that measure the inter-node link)."""
        return tuple(self.ranks_on(n)[0] for n in range(self.count))

    def label(self, node: int) -> str:
        return f"node {node} ({self.names[node]})"



def node_name() -> str:
    """This node's name: `hetrain run --node-name`, else the host name."""
    path = os.environ.get(LAUNCH_ENV)
    if path:
        try:
            with open(path) as f:
                name = (json.load(f).get("node") or {}).get("name")
            if name:
                return str(name)
        except (OSError, ValueError, AttributeError):
            pass                       # the launch file's problems are Config's to report
    return socket.gethostname()


def gather(*, rank: int, world_size: int, versions: dict | None = None, device: dict | None = None,
           own: dict | None = None) -> tuple[JobNodes, list[dict]]:
    """(the job's nodes, every rank's record). A collective when world_size > 1: every rank calls
    it. `device`: this rank's island_facts.rank_device record; `own`: what the caller adds to this
    rank's record. `agreed_restart(records)` is the job's attempt number: a node that joined later
    counts its own restarts from 0."""
    mine = {"group": int(os.environ.get("GROUP_RANK", "0") or 0), "name": node_name(),
            "versions": versions or {}, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "island": device or {}, **(own or {})}
    if world_size > 1:
        import torch.distributed as dist

        table: list = [None] * world_size
        dist.all_gather_object(table, mine)
    else:
        table = [mine]
    groups = sorted({t["group"] for t in table})
    node_of = tuple(groups.index(t["group"]) for t in table)
    names = tuple(next(t["name"] for t in table if t["group"] == g) for g in groups)
    return JobNodes(names=names, node_of=node_of), table


def agreed_restart(records: list[dict]) -> int:
    return max(int(r.get("restart", 0)) for r in records)


def describe(nodes: JobNodes, cluster) -> str:
    """One line per node: its name and its devices with their ranks (printed once, by rank 0)."""
    lines = [f"job: {len(nodes.node_of)} device(s) on {nodes.count} node(s), gathered at start:"]
    for n in range(nodes.count):
        ranks = nodes.ranks_on(n)
        devices = ", ".join(f"rank {r} {cluster[r].label} speed {cluster[r].speed:.2f}" if cluster is not None
                            else f"rank {r}" for r in ranks)
        lines.append(f"  {nodes.label(n)}: {devices}")
    return "\n".join(lines)


def join_nodes(ctx, config, log, *, own: dict | None = None, cluster_of=None, link=None):
    """Engine.__init__'s step after joining the group: every rank's node, device and versions
    gathered (a collective); the attempt number agreed; versions compared across nodes (one error
    on every rank, or warnings); the nodes and islands printed once. Returns (ctx, config, JobNodes,
    the job's cluster devices or None).

    Where the ranks' devices are a cluster spec's: `own` is what each rank adds to its record,
    `cluster_of(records, nodes, config)` gives (config, the job's parsed ClusterSpec or None) from
    the gathered records, and the islands, their bridge and links are the spec's, with `link(gbs,
    ring)` what carries a collective over a link of the spec's figures (island_facts.JobIslands).
    Otherwise the islands are what each rank found it trains on."""
    from dataclasses import replace

    from ...hardware.node_versions import check_node_versions, versions_here
    from .island_facts import job_islands, rank_device
    from .islands import spec_links

    nodes, records = gather(rank=ctx.rank, world_size=ctx.world_size,
                            versions=versions_here() if ctx.world_size > 1 else None,
                            device=rank_device(ctx.device), own=own)
    parsed = None
    if cluster_of is not None:
        config, parsed = cluster_of(records, nodes, config)
    held = [r["island"].get("backend", "") for r in records]     # what each rank's tensors are on
    if parsed is not None:
        bridge = parsed.topology.bridge
        islands = job_islands([rank_device(spec_device=d) for d in parsed.devices], bridge=bridge.name if bridge else "",
                              bridge_gbs=bridge.bandwidth_gbs if bridge else None, links_gbs=spec_links(parsed)[1],
                              held=held)
        islands = replace(islands, link=link)
    else:
        islands = job_islands([r["island"] for r in records], held=held)
    nodes = replace(nodes, islands=islands)
    cluster = parsed.devices if parsed is not None else None
    ctx = replace(ctx, restart=agreed_restart(records))   # what depends on the attempt is alike on every rank
    if nodes.spans_nodes:      # torch, CUDA, NCCL alike on every node of an island
        island_of = [islands.island_of(r).name for r in range(len(records))] if islands.multi else None
        for warning in check_node_versions([r["versions"] for r in records], list(nodes.node_of),
                                           list(nodes.names), island_of=island_of):
            log.warn_job(warning)
        log.info(describe(nodes, cluster))
    if islands.multi:
        log.info(islands.describe())
    return ctx, config, nodes, cluster
