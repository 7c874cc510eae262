"""Emulated devices across nodes and device islands: each node's `--emulate` spec joined into the
job's, and the island and bridge links the island spec names, modelled.

At start (Engine.__init__, `join_nodes`) every rank gathers every rank's node, device and versions
(runtime/ranks/nodes.py); a node launched with `--emulate` adds its rank's item of the node's spec.
From the gathered table every rank makes the same job-wide cluster spec (the nodes' items joined in
rank order, so speeds are scaled once for the whole job, hardware/cluster.py) and refuses the same
nodes together: an emulated node beside real GPUs, an island spec on several nodes. The islands
are then the job spec's, their groups gloo (emulated devices hold CPU tensors: ranks/island_facts.py
`held`), and every island's link and the bridge are the spec's figures: a collective over them
lasts what a link of that bandwidth would take (link.py LinkThrottle, through ranks/islands.py
`Islands.link`, attached by runtime/sharding/island_hooks.py attach_links).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import UsageError
from ..hardware.cluster import device_items, parse_cluster_spec
from ..hardware.islands import is_island_spec, join_node_items
from ..runtime.ranks import nodes as job_nodes


def node_device(spec: str | None, *, local_rank: int, local_world: int) -> str | None:
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


def job_spec(table: list[dict], nodes, spec: str | None) -> str | None:
    """The job's cluster spec from every rank's gathered item (None: real devices), the same on
    every rank; a job of emulated and real nodes, or islands over several nodes, is refused."""
    emulated = [t["device"] is not None for t in table]
    if any(emulated) and not all(emulated):
        side = "; ".join(f"{nodes.label(n)}: " + ("emulated devices" if emulated[nodes.ranks_on(n)[0]]
                                                   else "real GPUs (no --emulate)") for n in range(nodes.count))
        raise UsageError(f"some nodes emulate their devices and some do not ({side})",
                         "give every node's `hetrain run` an --emulate spec of its own devices, or none")
    # nodes of different vendors: one island each, the network between them the bridge
    joined = join_node_items([t["device"] for t in table]) if all(emulated) else None
    if joined is not None and is_island_spec(spec):
        if nodes.spans_nodes:
            raise UsageError(f"--emulate {spec!r} names device islands, which are on one machine, but the job "
                             f"spans {nodes.count} nodes",
                             "on several nodes give each node its own devices (node form or flat); islands "
                             "and their bridge= are one machine's")
        joined = spec            # one machine: its islands and bridge as given
    return joined


def paced_link(gbs: float, ring: int):
    """An emulated island's or bridge's link of `gbs` GB/s under a ring of `ring` ranks."""
    from .link import LinkThrottle

    return LinkThrottle(gbs=gbs, ring=ring)


def join_nodes(ctx, config, log):
    """Engine.__init__'s step after joining the group (runtime/ranks/nodes.py join_nodes, a
    collective), with this node's --emulate spec: the job's spec in the config in place of the
    node's, the islands the job spec's. Returns (ctx, config, JobNodes, the job's cluster or None:
    no emulation)."""
    spec = config.emulation.cluster

    def cluster_of(records, nodes, config):
        joined = job_spec(records, nodes, spec)
        if joined is None:
            return config, None
        return replace(config, emulation=replace(config.emulation, cluster=joined)), parse_cluster_spec(joined)

    own = {"device": node_device(spec, local_rank=ctx.local_rank, local_world=ctx.local_world_size)}
    return job_nodes.join_nodes(ctx, config, log, own=own, cluster_of=cluster_of, link=paced_link)
