"""NCCL settings for the link between nodes, from recorded machines' "net" sections: the socket
interface by the endpoint's subnet, by the default route, loopback only for a loopback endpoint;
InfiniBand/RoCE active, inactive, absent; the user's own settings kept. Plus the live network
query (hardware/netfacts.py) and the doctor's inter-node-network check."""

import json
import shutil
import socket
from pathlib import Path

import pytest

from hetrain.hardware import doctor, driver, machine, netfacts
from hetrain.hardware.findings import DoctorOptions
from hetrain.hardware.network import ifname_matches, nccl_link_fixes

MACHINES = Path(__file__).resolve().parents[2] / "fixtures" / "machines"
DGX, WORKSTATION, ROCE = "8xa100_sxm_nvlink", "a100_3090_pcie4", "l40s_roce_nccl_2.20"


def facts(name):
    return driver.load_machine(str(MACHINES / f"{name}.json"))


def fixes(name_or_facts, endpoint, environ=None, resolve=None):
    f = facts(name_or_facts) if isinstance(name_or_facts, str) else name_or_facts
    kw = {"resolve": resolve} if resolve else {"resolve": lambda host: pytest.fail(f"{host} resolved")}
    return {x.var: x for x in nccl_link_fixes(f, endpoint_host=endpoint, environ=environ or {}, **kw)}


def network_finding(f):
    (hit,) = [x for x in doctor.run_checks(machine.from_facts(f), DoctorOptions()) if x.check == "inter-node-network"]
    return hit


# -- the socket interface -----------------------------------------------------------------------
def test_the_interface_on_the_endpoints_subnet_wins_over_the_default_route():
    got = fixes(DGX, "192.168.100.5")
    assert got["NCCL_SOCKET_IFNAME"].value == "=ib0" and got["GLOO_SOCKET_IFNAME"].value == "ib0"
    assert "ib0 (192.168.100.11/24) is on the subnet of the rendezvous endpoint 192.168.100.5" in \
        got["NCCL_SOCKET_IFNAME"].reason


def test_the_most_specific_subnet_wins():
    f = facts(ROCE)
    eno1 = next(i for i in f["net"]["interfaces"] if i["name"] == "eno1")
    eno1["ipv4"].append("10.0.0.9/8")                  # 10.30.0.5 is in 10.0.0.0/8 and in 10.30.0.0/24
    assert fixes(f, "10.30.0.5")["NCCL_SOCKET_IFNAME"].value == "=ens1f0np0"


def test_a_host_name_is_resolved_and_matched_by_subnet():
    got = fixes(ROCE, "gpu01", resolve=lambda host: ["10.30.0.5"] if host == "gpu01" else [])
    assert got["NCCL_SOCKET_IFNAME"].value == "=ens1f0np0"
    assert "rendezvous endpoint gpu01 (10.30.0.5)" in got["NCCL_SOCKET_IFNAME"].reason


def test_no_subnet_match_takes_the_default_route_never_docker_or_loopback():
    got = fixes(ROCE, "10.99.1.1")
    assert got["NCCL_SOCKET_IFNAME"].value == "=eno1"
    assert "no interface here is on the rendezvous endpoint 10.99.1.1's subnet; eno1 (172.16.5.21/22) has the " \
           "default route" in got["NCCL_SOCKET_IFNAME"].reason
    unresolved = fixes(WORKSTATION, "gpu99", resolve=lambda host: [])
    assert unresolved["NCCL_SOCKET_IFNAME"].value == "=eno1"
    assert "gpu99 does not resolve here" in unresolved["NCCL_SOCKET_IFNAME"].reason


def test_this_machines_own_name_resolving_to_loopback_is_not_loopback():
    """Debian/Ubuntu map the host's own name to 127.0.1.1: the first node must still use its network."""
    got = fixes(ROCE, "l40s-roce", resolve=lambda host: ["127.0.1.1"])
    assert got["NCCL_SOCKET_IFNAME"].value == "=eno1"
    assert "this machine's own name, which resolves to loopback here" in got["NCCL_SOCKET_IFNAME"].reason


def test_a_loopback_endpoint_uses_loopback_and_says_it_is_for_one_machine_tests():
    for endpoint, resolve in (("127.0.0.1", None), ("::1", None), ("localhost", lambda host: ["127.0.0.1"])):
        got = fixes(WORKSTATION, endpoint, resolve=resolve)
        assert got["NCCL_SOCKET_IFNAME"].value == "=lo" and got["GLOO_SOCKET_IFNAME"].value == "lo"
        assert "is loopback" in got["NCCL_SOCKET_IFNAME"].reason and "one-machine tests" in got["NCCL_SOCKET_IFNAME"].reason


def test_no_usable_interface_sets_no_interface():
    f = facts(WORKSTATION)
    f["net"]["interfaces"] = [i for i in f["net"]["interfaces"] if i["loopback"]]
    got = fixes(f, "10.1.1.1")
    assert "NCCL_SOCKET_IFNAME" not in got and got["NCCL_IB_DISABLE"].value == "1"
    finding = network_finding(f)
    assert finding.level == "warn" and "no interface for other nodes to reach" in finding.message and finding.fix


# -- InfiniBand / RoCE ----------------------------------------------------------------------------
def test_active_infiniband_ports_are_named_exactly_and_the_dead_one_left_out():
    hca = fixes(DGX, "192.168.100.5")["NCCL_IB_HCA"]
    assert hca.value == "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
    assert "mlx5_0:1 InfiniBand 200 Gb/sec (4X HDR)" in hca.reason and "left out: mlx5_4:1 DOWN" in hca.reason


def test_roce_needs_its_netdev_up_with_an_address():
    hca = fixes(ROCE, "10.30.0.5")["NCCL_IB_HCA"]
    assert hca.value == "=mlx5_0:1"
    assert "mlx5_0:1 Ethernet" in hca.reason and "mlx5_1:1 RoCE on ens1f1np1, which is down or has no IPv4" in hca.reason


def test_devices_without_an_active_port_disable_infiniband_with_a_warning():
    f = facts(DGX)
    for dev in f["net"]["ib"]:
        for port in dev["ports"]:
            port["state"] = "DOWN"
    off = fixes(f, "192.168.100.5")["NCCL_IB_DISABLE"]
    assert off.value == "1" and off.reason.startswith("NCCL_IB_DISABLE=1: warning: InfiniBand/RoCE device(s) but "
                                                      "no active port (mlx5_0:1 DOWN;")
    assert "sockets over ib0" in off.reason
    finding = network_finding(f)
    assert finding.level == "warn" and "no active port" in finding.message and "ibstat" in finding.fix


def test_no_infiniband_device_disables_it():
    got = fixes(WORKSTATION, "192.168.1.10")
    assert list(got) == ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE"]
    assert got["NCCL_IB_DISABLE"].value == "1"
    assert "no InfiniBand/RoCE device here" in got["NCCL_IB_DISABLE"].reason and "sockets over eno1" in \
        got["NCCL_IB_DISABLE"].reason


# -- the user's settings --------------------------------------------------------------------------
def test_variables_the_user_set_are_kept_and_said_so():
    got = fixes(DGX, "10.10.0.2", environ={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0"})
    ifname = got["NCCL_SOCKET_IFNAME"]
    assert ifname.value == "ib0" and "kept as you set it (hetrain would set =enp226s0" in ifname.reason
    assert got["NCCL_IB_HCA"].value == "mlx5_0" and "kept as you set it" in got["NCCL_IB_HCA"].reason
    assert "NCCL_IB_DISABLE" not in got                 # the user chose InfiniBand: nothing added to it
    assert got["GLOO_SOCKET_IFNAME"].value == "enp226s0"


def test_a_user_interface_that_names_nothing_here_is_said():
    got = fixes(WORKSTATION, "192.168.1.10", environ={"NCCL_SOCKET_IFNAME": "bond0"})
    assert got["NCCL_SOCKET_IFNAME"].value == "bond0"
    assert "names no interface here (lo, eno1, docker0)" in got["NCCL_SOCKET_IFNAME"].reason
    f = facts(WORKSTATION)
    f["env"] = {"NCCL_SOCKET_IFNAME": "bond0"}
    assert network_finding(f).level == "warn"


@pytest.mark.parametrize("spec,hits", [("eth", ["eth0", "eth10"]), ("=eth1", []), ("=eth0", ["eth0"]),
                                       ("^docker", ["eth0", "eth10", "lo"]), ("^=eth0,lo", ["eth10", "docker0"]),
                                       ("eth1,do", ["eth10", "docker0"])])
def test_ifname_follows_nccl_rules(spec, hits):
    assert ifname_matches(spec, ["eth0", "eth10", "docker0", "lo"]) == hits


def test_a_description_without_network_facts_gives_no_fixes_and_a_skipped_check():
    old = facts("cpu_only")
    assert old["net"] is None and nccl_link_fixes(old, endpoint_host="10.0.0.1", environ={}) == []
    finding = network_finding(old)
    assert finding.level == "skipped" and "no network facts" in finding.message
    planned = [f for f in doctor.run_checks(machine.planned("a100-80g,rtx3090")) if f.check == "inter-node-network"]
    assert [f.level for f in planned] == ["skipped"]


def test_the_doctor_says_what_a_multi_node_job_would_use():
    dgx = network_finding(facts(DGX))
    assert dgx.level == "ok" and "NCCL_SOCKET_IFNAME=ib0 (yours)" in dgx.message
    assert "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1" in dgx.message and "mlx5_4 port 1 DOWN" in dgx.message
    ws = network_finding(facts(WORKSTATION))
    assert ws.level == "ok" and "eno1 (192.168.1.23/24) has the default route" in ws.message
    assert "NCCL_IB_DISABLE=1" in ws.message and ws.env == ()     # nothing for a one-machine launch


# -- the live query -------------------------------------------------------------------------------
def test_the_live_query_finds_loopback_and_agrees_with_the_ioctl():
    net = netfacts.query_net()
    lo = next(i for i in net["interfaces"] if i["loopback"])
    assert lo["up"] and "127.0.0.1/8" in lo["ipv4"]
    assert {i["name"] for i in net["interfaces"]} == {name for _i, name in socket.if_nameindex()}
    for iface in net["interfaces"]:          # `ip -j addr` (when present) and SIOCGIFADDR: the same primary address
        primary = netfacts._ipv4_by_ioctl(iface["name"])
        assert primary == iface["ipv4"][:1] if iface["ipv4"] else primary == [], iface
    json.dumps(net)


def test_the_live_query_without_ip_uses_the_ioctl(monkeypatch):
    with_ip = netfacts.query_net()
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    without = netfacts.query_net()
    assert [(i["name"], i["ipv4"][:1]) for i in without["interfaces"]] == \
           [(i["name"], i["ipv4"][:1]) for i in with_ip["interfaces"]]


def _fake_sys(root: Path) -> None:
    for name, flags, state in (("lo", "0x9", "unknown"), ("eth0", "0x1003", "up"), ("docker0", "0x1003", "down"),
                               ("ib0", "0x1043", "up")):
        d = root / "sys/class/net" / name
        d.mkdir(parents=True)
        (d / "flags").write_text(flags + "\n")
        (d / "operstate").write_text(state + "\n")
    (root / "proc/net").mkdir(parents=True)
    (root / "proc/net/route").write_text(
        "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
        "ib0\t00000000\t0164A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n"
        "eth0\t00000000\t01000A0A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
        "eth0\t00000A0A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n")
    for dev, state, layer, netdev in (("mlx5_0", "4: ACTIVE", "InfiniBand", "ib0"), ("mlx5_1", "1: DOWN", "Ethernet", None)):
        port = root / "sys/class/infiniband" / dev / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "link_layer").write_text(layer + "\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        if netdev:
            (root / "sys/class/infiniband" / dev / "device/net" / netdev).mkdir(parents=True)


def test_the_query_reads_sys_and_proc(tmp_path):
    _fake_sys(tmp_path)
    net = netfacts.query_net(root=str(tmp_path))
    by = {i["name"]: i for i in net["interfaces"]}
    assert by["lo"]["loopback"] and by["lo"]["up"] and by["eth0"]["up"] and not by["eth0"]["loopback"]
    assert not by["docker0"]["up"]                      # IFF_UP, but no carrier: operstate down
    assert net["default_route"] == "eth0"               # the lower metric of two default routes
    assert net["ib"] == [
        {"name": "mlx5_0", "netdevs": ["ib0"], "ports": [{"port": 1, "state": "ACTIVE", "link_layer": "InfiniBand",
                                                           "rate": "200 Gb/sec (4X HDR)"}]},
        {"name": "mlx5_1", "netdevs": [], "ports": [{"port": 1, "state": "DOWN", "link_layer": "Ethernet",
                                                      "rate": "200 Gb/sec (4X HDR)"}]}]


def test_the_query_never_raises_on_a_broken_system(tmp_path):
    (tmp_path / "sys/class").mkdir(parents=True)
    (tmp_path / "sys/class/infiniband").write_text("not a directory")
    net = netfacts.query_net(root=str(tmp_path))
    assert net["interfaces"] == [] and net["default_route"] is None and net["ib"] == []
    assert any("/sys/class/net" in e for e in net["errors"]) and any("infiniband" in e for e in net["errors"])


def test_the_machine_description_has_the_network(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)       # no NVML: the network is still described
    f = driver.query_machine()
    assert any(i["loopback"] for i in f["net"]["interfaces"])
    assert isinstance(f["net"]["errors"], list) and json.dumps(f["net"])
