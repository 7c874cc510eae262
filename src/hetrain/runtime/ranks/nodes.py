"""The job's nodes: which rank runs on which machine, and the job's whole cluster, gathered at start.

Under a multi-node launch (`hetrain run --nnodes N ...` on torchrun's c10d rendezvous) every node's
launcher knows only its own devices: its `--emulate` spec, or its visible GPUs. torchrun numbers
the nodes (GROUP_RANK, the node's rank in this rendezvous round) and gives each node's processes
consecutive ranks; nodes may run different process counts (an A100 node beside a two-3090 node).
`gather` is one all_gather_object, entered by every rank in Engine.__init__, that gives every rank
every rank's node, node name, emulated device and versions. From that table all ranks build the
same JobNodes and the same job-wide cluster spec (the nodes' specs joined in rank order, so
speeds are scaled once for the whole job, hardware/cluster.py) and take the same decision on a
node that does not fit the job (an emulated node beside real GPUs; torch or NCCL versions that
differ: hardware/node_versions.py), so all raise the same error together.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from ...errors import UsageError
from ...hardware.cluster import device_items, parse_cluster_spec
from ...hardware.islands import is_island_spec, join_node_items
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


def local_device(spec: str | None, *, local_rank: int, local_world: int) -> str | None:
    """This rank's item of its node's cluster spec ('a100-80g:1.0@40MiB'), or None (no emulation)."""
    if spec is None:
        return None
    items = device_items(spec)
    if len(items) != local_world:
        raise UsageError(
            f"--emulate {spec!r} names {len(items)} device(s), but this node runs {local_world} process(es)",
            f"on each node, --emulate names that node's own devices: launch with `hetrain run --emulate {spec} "
            "...` (one process per emulated device)")
    return items[local_rank]


def gather(*, rank: int, world_size: int, local_rank: int, local_world: int, spec: str | None,
           versions: dict | None = None, device: dict | None = None) -> tuple[JobNodes, str | None, list[dict]]:
    """(the job's nodes, the job's cluster spec or None, every rank's record). A collective when
    world_size > 1: every rank calls it, with its own node's spec. `agreed_restart(records)`
    is the job's attempt number: a node that joined later counts its own restarts from 0."""
    mine = {"group": int(os.environ.get("GROUP_RANK", "0") or 0), "name": node_name(),
            "device": local_device(spec, local_rank=local_rank, local_world=local_world),
            "versions": versions or {}, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "island": device or {}}
    if world_size > 1:
        import torch.distributed as dist

        table: list = [None] * world_size
        dist.all_gather_object(table, mine)
    else:
        table = [mine]
    groups = sorted({t["group"] for t in table})
    node_of = tuple(groups.index(t["group"]) for t in table)
    names = tuple(next(t["name"] for t in table if t["group"] == g) for g in groups)
    nodes = JobNodes(names=names, node_of=node_of)
    emulated = [t["device"] is not None for t in table]
    if any(emulated) and not all(emulated):
        side = "; ".join(f"{nodes.label(n)}: " + ("emulated devices" if emulated[nodes.ranks_on(n)[0]]
                                                   else "real GPUs (no --emulate)") for n in range(nodes.count))
        raise UsageError(f"some nodes emulate their devices and some do not ({side})",
                         "give every node's `hetrain run` an --emulate spec of its own devices, or none")
    # nodes of different vendors: one island each, the network between them the bridge
    job_spec = join_node_items([t["device"] for t in table]) if all(emulated) else None
    if job_spec is not None and is_island_spec(spec):
        if nodes.spans_nodes:
            raise UsageError(f"--emulate {spec!r} names device islands, which are on one machine, but the job "
                             f"spans {nodes.count} nodes",
                             "on several nodes give each node its own devices (node form or flat); islands "
                             "and their bridge= are one machine's")
        job_spec = spec            # one machine: its islands and bridge as given
    return nodes, job_spec, table


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


def join_nodes(ctx, config, log):
    """Engine.__init__'s step after joining the group: every rank's node, device and versions
    gathered (a collective); the job's cluster spec in place of this node's; the attempt number
    agreed; versions compared across nodes (one error on every rank, or warnings); the nodes
    printed once. Returns (ctx, config, JobNodes, the job's cluster or None: no emulation)."""
    from dataclasses import replace

    from ...hardware.node_versions import check_node_versions, versions_here
    from .island_facts import job_islands, rank_device

    spec = config.emulation.cluster
    nodes, job_spec, records = gather(rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank,
                                      local_world=ctx.local_world_size, spec=spec,
                                      versions=versions_here() if ctx.world_size > 1 else None,
                                      device=rank_device(ctx.device) if spec is None else None)
    parsed = parse_cluster_spec(job_spec) if job_spec is not None else None
    cluster = parsed.devices if parsed is not None else None
    bridge = parsed.topology.bridge if parsed is not None else None
    # emulation: the job-wide spec's islands; real devices: what each rank found it trains on
    facts = [rank_device(emulated=d) for d in parsed.devices] if parsed is not None else [r["island"] for r in records]
    islands = job_islands(facts, bridge=bridge.name if bridge else "",
                          bridge_gbs=bridge.bandwidth_gbs if bridge else None)
    nodes = replace(nodes, islands=islands)
    if job_spec is not None:
        config = replace(config, emulation=replace(config.emulation, cluster=job_spec))
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
