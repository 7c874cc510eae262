"""`hetrain simulate` on device islands joined by a bridge (cli/islands_show.py): the three ways to
train them, the verdict, the warning, the ratio to a one-vendor cluster. The first test goes
through the island spec's parser; the second hands the command records the parser refuses."""

from __future__ import annotations

import json
from dataclasses import replace

from clirun import hetrain_here
from hetrain.hardware import catalog
from hetrain.hardware.cluster import ClusterDevice, ClusterSpec, Node, Topology
from hetrain.planning.islands import HIER, PP, SUBSET

A100 = catalog.resolve("a100-80g")
AMD = replace(A100, key="amd-like", vendor="amd")


def device(i, gpu, speed, island):
    return ClusterDevice(index=i, gpu=gpu, speed=speed, speed_source="given", memory_bytes=gpu.memory_bytes,
                         memory_source="catalog", island=island)


def test_simulate_shows_the_three_ways_for_an_island_spec():
    r = hetrain_here("simulate", "--cluster", "nv=2xa100-80g; amd=2xmi300x:0.9; bridge=host:1GbE", "--model", "gpt2-124m")
    assert r.returncode == 0, r.stderr
    for name in (HIER, PP, SUBSET):
        assert f"• {name}: " in r.stdout
    assert "• only nv trains: " in r.stdout and "• warning: the bridge (0.113 GB/s" in r.stdout
    assert "this cluster reaches" in r.stdout
    r = hetrain_here("simulate", "--cluster", "nv=2xa100-80g; amd=2xmi300x:0.9; bridge=host:ib-ndr", "--model", "gpt2-124m",
                     "--json")
    whole = json.loads(r.stdout)
    out = whole["islands"]
    assert out["best"] == HIER and out["warning"] == "" and 0.85 < out["homogeneous"]["ratio"] <= 1.0
    # The DP table and the layout ranking plan with the bridge too: their ring is the hierarchical all-reduce's.
    source = whole["link"]["source"]
    assert source.startswith("hierarchical across 2 device islands over the bridge (") and "ib-ndr" in source


def test_islands_without_a_bridge_are_one_line_exit_2(monkeypatch):
    import hetrain.cli.simulate as sim

    devices = [device(0, A100, 1.0, "nv"), device(1, AMD, 0.9, "amd")]
    nodes = (Node(name="node0", devices=(0, 1), part="a100-80g,a100-80g", link=None),)
    monkeypatch.setattr(sim, "parse_cluster_spec", lambda text: ClusterSpec(
        devices=tuple(devices), topology=Topology(nodes=nodes, net=None, named=False)))
    r = hetrain_here("simulate", "--cluster", "nv=a100-80g; amd=amd", "--model", "gpt2-124m")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "names no bridge between them" in r.stderr and "bridge=host:25GbE" in r.stderr
