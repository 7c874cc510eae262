"""Doctor check on the network a multi-node job would use: the interfaces and InfiniBand/RoCE
devices found, and what NCCL will use (hardware/network.py chooses it; `hetrain run --nnodes`
sets it against the real rendezvous endpoint).

Its findings carry no environment fixes: a one-machine job needs none of this, and the launcher
sets the link variables only for a multi-node job (network.nccl_link_fixes).
"""

from __future__ import annotations

from .findings import DoctorOptions, Finding, skipped
from .machine import Machine
from .network import IB_VARS, ib_setting, ifname_matches, socket_interface

CHECK = "inter-node-network"


def _interfaces_text(net: dict) -> str:
    parts = []
    for i in net.get("interfaces") or ():
        if i.get("loopback"):
            continue
        state = "" if i.get("up") else " (down)"
        route = " (default route)" if i.get("name") == net.get("default_route") else ""
        parts.append(f"{i.get('name')} {', '.join(i.get('ipv4') or ()) or 'no IPv4'}{route}{state}")
    return "; ".join(parts) or "none but loopback"


def _ib_text(net: dict) -> str:
    def ports(d):
        return ", ".join(f"port {p.get('port')} {p.get('state')} {p.get('link_layer') or ''}".rstrip()
                         for p in d.get("ports") or ())

    return "; ".join(f"{d.get('name')} {ports(d)}" for d in net.get("ib") or ()) or "none"


def check_inter_node_network(m: Machine, o: DoctorOptions) -> list[Finding]:
    if m.planned:
        return [skipped(CHECK, "a planned cluster: no network to look at")]
    net = m.facts.get("net")
    if not net:
        return [skipped(CHECK, "no network facts (recorded before hetrain looked at the network)",
                        "record the machine again with `hetrain env --json`")]
    found = f"interfaces: {_interfaces_text(net)}; InfiniBand/RoCE: {_ib_text(net)}"
    env = m.env
    iface, why = socket_interface(m.facts, None)
    ib_var, ib_value, ib_why = ib_setting(net, iface)
    out = []
    if iface is None:
        out.append(Finding(level="warn", check=CHECK, message=f"no interface for other nodes to reach ({why}); {found}",
                           why="a multi-node job cannot connect this machine to the others",
                           fix="bring up the network interface (`ip addr`), or give NCCL_SOCKET_IFNAME=<interface>"))
    user_ifname = env.get("NCCL_SOCKET_IFNAME")
    names = [i.get("name") for i in net.get("interfaces") or ()]
    if user_ifname is not None and not ifname_matches(user_ifname, names):
        out.append(Finding(level="warn", check=CHECK,
                           message=f"NCCL_SOCKET_IFNAME={user_ifname} names no interface here ({', '.join(names)})",
                           why="NCCL fails to start with 'no socket interface found'",
                           fix="unset it (hetrain run chooses the interface that reaches the rendezvous "
                               "endpoint) or name one of the interfaces above"))
    if ib_why.startswith("warning:"):
        out.append(Finding(level="warn", check=CHECK, message=ib_why.removeprefix("warning: "),
                           why="InfiniBand would carry the gradients many times faster than TCP sockets",
                           fix="check the cables and the subnet manager (`ibstat`); hetrain run sets "
                               "NCCL_IB_DISABLE=1 meanwhile"))
    if out:
        return out
    sockets = f"NCCL_SOCKET_IFNAME={user_ifname} (yours)" if user_ifname is not None else f"sockets: {why}"
    user_ib = [f"{v}={env[v]}" for v in IB_VARS if v in env]
    left_out = f" ({ib_why[ib_why.index('left out'):]})" if "left out" in ib_why else ""
    ib = f"{', '.join(user_ib)} (yours)" if user_ib else f"{ib_var}={ib_value}{left_out}"
    uses = f"NCCL will use {sockets}, and {ib}"
    return [Finding(level="ok", check=CHECK,
                    message=f"{found}; for a multi-node job {uses}; hetrain run --nnodes picks the interface "
                            "that reaches the rendezvous endpoint")]


CHECKS = (check_inter_node_network,)
