"""A cluster spec's nodes and links as the cost model sees them, and what the link between nodes
costs (pure).

The gradient all-reduce over nodes is costed hierarchically (collectives.py
`hierarchical_allreduce_seconds`): a ring inside each node over the node's own link (given in the
spec, else the catalog's, cost.py `catalog_link`), an all-reduce across nodes over `net=`, and the
ring inside each node again. The planner models one ring, so it is handed the single link that
takes as long (`hierarchical_link`). What the slow link costs: the same all-reduce with the nodes
joined as fast as the slowest node's own link, as if the cluster were one machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware.cluster import ClusterSpec
from ..hardware.links import LinkSpec
from .collectives import Link, hierarchical_allreduce_seconds, link_from_measurement
from .cost import catalog_link


def _link(spec: LinkSpec) -> Link:
    return Link(bandwidth_gbs=spec.bandwidth_gbs, latency_s=spec.latency_s, source=spec.source)


@dataclass(frozen=True, kw_only=True)
class TopologySync:
    """The gradient all-reduce over a cluster spec's nodes."""

    node_names: tuple[str, ...]
    node_sizes: tuple[int, ...]
    node_links: tuple[Link, ...]
    net: Link | None                 # None: one node
    sync_s: float                    # hierarchical all-reduce of the gradient
    joined_s: float                  # the same with the nodes joined at the slowest node link
    link: Link                       # one ring link as slow as the hierarchical all-reduce

    @property
    def net_cost_s(self) -> float:
        """What the link between nodes adds to every all-reduce of the gradient."""
        return self.sync_s - self.joined_s

    def describe_nodes(self, *, limit: int = 8) -> str:
        """Each node's devices and link; beyond `limit` nodes, one entry per kind of node."""
        if len(self.node_names) <= limit:
            return "; ".join(f"{name}: {n} device(s), {link.bandwidth_gbs:.3g} GB/s ({link.source})"
                             for name, n, link in zip(self.node_names, self.node_sizes, self.node_links))
        kinds: dict[tuple, list[str]] = {}
        for name, n, link in zip(self.node_names, self.node_sizes, self.node_links):
            kinds.setdefault((n, link.bandwidth_gbs, link.source), []).append(name)
        return "; ".join(f"{len(names)} nodes ({names[0]}, ...) of {n} device(s), {gbs:.3g} GB/s ({source})"
                         for (n, gbs, source), names in kinds.items())

    def to_dict(self) -> dict:
        return {"nodes": [{"name": name, "devices": n, "link_gbs": link.bandwidth_gbs, "link": link.source}
                          for name, n, link in zip(self.node_names, self.node_sizes, self.node_links)],
                "net": None if self.net is None else {"bandwidth_gbs": self.net.bandwidth_gbs,
                                                      "source": self.net.source},
                "sync_s": self.sync_s, "joined_s": self.joined_s, "net_cost_s": self.net_cost_s}


def node_links(cluster: ClusterSpec) -> tuple[Link, ...]:
    """Each node's own link: as the spec names it, else the catalog's for its cards."""
    out = []
    for node in cluster.topology.nodes:
        if node.link is not None:
            out.append(_link(node.link))
        else:
            out.append(catalog_link([cluster.devices[i].gpu for i in node.devices]))
    return tuple(out)


def topology_sync(cluster: ClusterSpec, grad_bytes: float) -> TopologySync:
    """The hierarchical gradient all-reduce of this cluster, and the same with a link between
    nodes as fast as the slowest node's own."""
    topo = cluster.topology
    sizes = tuple(len(n.devices) for n in topo.nodes)
    intra = node_links(cluster)
    net = _link(topo.net) if topo.net is not None and len(sizes) > 1 else None
    slowest = min(intra, key=lambda link: link.bandwidth_gbs)
    inter = net or slowest
    sync = hierarchical_allreduce_seconds(sizes, grad_bytes, intra, inter)
    joined = hierarchical_allreduce_seconds(sizes, grad_bytes, intra, slowest)
    if net is None:
        source = f"one node: {slowest.source}"
    else:
        source = (f"hierarchical: a ring in each of {len(sizes)} nodes (slowest {slowest.bandwidth_gbs:.3g} GB/s), "
                  f"all-reduce across them over {net.source}")
    return TopologySync(node_names=tuple(n.name for n in topo.nodes), node_sizes=sizes, node_links=intra,
                        net=net, sync_s=sync, joined_s=joined,
                        link=link_from_measurement(sum(sizes), grad_bytes, sync, source))    # hierarchical_link's
