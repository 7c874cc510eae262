from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.hardware.cluster import parse_cluster
from hetrain.hardware.units import format_bytes, parse_bytes


def test_catalog_speeds_relative_to_the_fastest():
    a, b = parse_cluster("a100-80g,rtx3090")
    assert a.speed == 1.0 and b.speed == pytest.approx(0.67)
    assert "catalog" in b.speed_source and b.memory_bytes == 24 * 1024**3


def test_given_speed_and_memory_cap():
    a, b = parse_cluster("a100-80g:1.0, rtx3090:0.5@1GiB")
    assert b.speed == 0.5 and b.memory_bytes == 1024**3 and b.memory_source == "given cap"


def test_counts_and_driver_names():
    devices = parse_cluster("2x3090,NVIDIA A100-SXM4-80GB")
    assert [d.gpu.key for d in devices] == ["rtx3090", "rtx3090", "a100-80g"]
    assert [d.index for d in devices] == [0, 1, 2]


@pytest.mark.parametrize("spec, words", [
    ("", "empty"),
    ("a100,,3090", "empty item"),
    ("a100:fast", "not a number"),
    ("a100:-1", "positive"),
    ("a100:0", "positive"),
    ("a100@2zz", "cannot read memory"),
    ("a100@0GiB", "zero"),
    ("rtx309", "did you mean"),
    ("a100:nan", "positive"),
    ("a100:inf", "positive"),
    ("a100:0.005", "(0.01, 100]"),
    ("a100:101", "(0.01, 100]"),
    ("a100@512", "from 1KiB to 1PiB"),
    ("1000000000xa100-80g", "from 1 to 1024"),          # was: expanded device by device, memory exhausted
    ("9" * 5000 + "xa100", "from 1 to 1024"),           # was: int() of 5000 digits, a ValueError
    ("0xa100", "from 1 to 1024"),
    ("1000xa100,30xrtx3090", "at most 1024 devices"),
])
def test_malformed_specs_name_the_bad_part_and_the_forms(spec, words):
    with pytest.raises(UsageError) as e:
        parse_cluster(spec)
    assert words in e.value.what
    assert "NAME:SPEED@MEMORY" in e.value.fix


def test_bounds_are_inclusive_where_they_say():
    assert len(parse_cluster("1024xa100")) == 1024
    (fast,) = parse_cluster("a100:100@1KiB")
    assert fast.speed == 1.0 and fast.memory_bytes == 1024     # rescaled: the fastest runs at full pace
    assert parse_cluster("a100:0.011,a100:1")[0].speed == pytest.approx(0.011)


def test_units():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes("1.5g") == int(1.5 * 1024**3)
    assert format_bytes(1536 * 1024**2) == "1.5 GiB"
    with pytest.raises(UsageError):
        parse_bytes("lots")


def test_one_cpu_thread_plays_an_a100_unless_a_faster_device_is_present():
    (alone,) = parse_cluster("rtx3090")
    assert alone.speed == pytest.approx(0.67)           # a 3090 alone still runs at its own pace
    h100, a100 = parse_cluster("h100-sxm,a100-80g")
    assert h100.speed == 1.0 and a100.speed == pytest.approx(1 / h100.gpu.speed_index)


# -- nodes and links --------------------------------------------------------------------------
def test_a_node_spec_gives_devices_in_node_order_and_the_topology():
    from hetrain.hardware.cluster import device_items, parse_cluster_spec

    c = parse_cluster_spec("node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE")
    assert [d.gpu.key for d in c.devices] == ["a100-80g"] * 2 + ["rtx3090"] * 4
    node0, node1 = c.topology.nodes
    assert (node0.name, node0.devices, node1.devices) == ("node0", (0, 1), (2, 3, 4, 5))
    assert c.topology.node_of(3) is node1
    assert node0.link.bandwidth_gbs == pytest.approx(0.4 * 600)        # the A100's NVLink, at NCCL's 40%
    assert node1.link.bandwidth_gbs == 24.0
    assert c.topology.net.bandwidth_gbs == pytest.approx(25 / 8 * 0.9)
    assert parse_cluster("node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE") == c.devices
    assert device_items("a=2xa100@1GiB; b=rtx3090; net=10GbE") == ("a100@1GiB", "a100@1GiB", "rtx3090")
    # speeds are rescaled over the whole cluster, as for the flat spec of the same devices
    assert parse_cluster("a=h100-sxm; b=a100-80g; net=ib-hdr") == parse_cluster("h100-sxm,a100-80g")


def test_a_flat_spec_is_one_node_with_its_link_from_the_catalog():
    from hetrain.hardware.cluster import parse_cluster_spec

    t = parse_cluster_spec("a100-80g,rtx3090").topology
    assert not t.named and t.net is None and len(t.nodes) == 1
    assert t.nodes[0].devices == (0, 1) and t.nodes[0].link is None


@pytest.mark.parametrize("text, gbs", [
    ("12GB/s", 12.0), ("100Gb/s", 12.5), ("25Gbit", 3.125), ("800MB/s", 0.8), ("40Gbps", 5.0),
    ("1GiB/s", 1024**3 / 1e9), ("PCIe3", 12.0), ("100gbe", 100 / 8 * 0.9), ("ib-hdr", 200 / 8 * 0.9),
])
def test_link_names_and_units(text, gbs):
    from hetrain.hardware.links import parse_link

    assert parse_link(text, where="here").bandwidth_gbs == pytest.approx(gbs)


@pytest.mark.parametrize("spec, words", [
    ("a=a100; a=rtx3090; net=10GbE", "named twice"),
    ("a=a100; A=rtx3090; net=10GbE", "named twice"),
    ("a=a100/12GHz", "unit 'GHz' is not understood"),
    ("a=a100; b=a100; net=25 furlongs", "not understood"),
    ("a=a100; b=a100; net=fastnet", "not a known link name"),
    ("a=a100; b=a100", "no net=LINK"),
    ("a=a100; b=a100; net=10GbE; net=25GbE", "twice"),
    ("a=a100; rtx3090", "without NODE="),
    ("a b=a100", "node name"),
    ("a=/pcie4", "no devices"),
    ("a=rtx4090/nvlink", "no NVLink"),
    ("a=a100,h100-sxm/nvlink", "different card models"),
    ("a=a100; b=a100; net=nvlink", "not nodes"),
    ("a=a100; b=a100; net=0GB/s", "positive"),
])
def test_bad_node_specs_are_one_line_naming_the_part(spec, words):
    with pytest.raises(UsageError) as e:
        parse_cluster(spec)
    assert words in e.value.what and "\n" not in e.value.what
    assert "e.g. node0=" in e.value.fix
