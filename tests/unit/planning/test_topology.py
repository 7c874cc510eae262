"""The hierarchical all-reduce: the flat ring for one node, a hand computation for two."""

from __future__ import annotations

import pytest

from hetrain.hardware.cluster import parse_cluster_spec
from hetrain.planning.collectives import Link, allreduce_seconds, hierarchical_allreduce_seconds, hierarchical_link
from hetrain.planning.cost import catalog_link
from hetrain.planning.topology import topology_sync

S = 500e6


def test_one_node_is_the_flat_ring():
    link = Link(bandwidth_gbs=24.0, latency_s=1e-5)
    for n in (1, 2, 4, 7):
        assert hierarchical_allreduce_seconds([n], S, [link], Link(bandwidth_gbs=1.0)) == \
            pytest.approx(allreduce_seconds(n, S, link))


def test_two_nodes_by_hand():
    nv, pcie, net = (Link(bandwidth_gbs=240.0, latency_s=1e-5), Link(bandwidth_gbs=24.0, latency_s=1e-5),
                     Link(bandwidth_gbs=2.5, latency_s=5e-5))
    # node0: 2 cards on NVLink; node1: 4 on PCIe (the slower node sets both in-node phases)
    rs0 = 1 / 2 * S / 240e9 + 1 * 1e-5
    rs1 = 3 / 4 * S / 24e9 + 3 * 1e-5
    across = 2 * 1 / 2 * S / 2.5e9 + 2 * 1 * 5e-5
    want = 2 * max(rs0, rs1) + across
    assert hierarchical_allreduce_seconds([2, 4], S, [nv, pcie], net) == pytest.approx(want)
    # the one ring link the planner gets takes as long over all 6 devices
    flat = hierarchical_link([2, 4], S, [nv, pcie], net, source="t")
    assert allreduce_seconds(6, S, flat) == pytest.approx(want)


def test_a_spec_s_links_and_what_the_slow_one_costs():
    c = parse_cluster_spec("node0=2xa100-80g/nvlink; node1=4xrtx3090; net=25GbE")
    t = topology_sync(c, S)
    assert t.node_links[1].bandwidth_gbs == catalog_link([c.devices[2].gpu] * 4).bandwidth_gbs   # from the catalog
    joined = hierarchical_allreduce_seconds([2, 4], S, t.node_links, t.node_links[1])
    assert t.joined_s == pytest.approx(joined) and t.sync_s > joined
