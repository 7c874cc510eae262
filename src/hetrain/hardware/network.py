"""The NCCL (and gloo) environment for the link between nodes, chosen from the machine
description's "net" section (hardware/netfacts.py) and the rendezvous endpoint.

Left alone, NCCL picks the first interface that is not loopback or docker, and tries InfiniBand
whenever the verbs library loads: on a node with a management and a data network, or a docker
bridge, or an HCA whose cable is out, the nodes then fail to connect or stall. The rule here: the
socket interface is the one whose IPv4 subnet holds the endpoint's address (the longest prefix),
else the default-route interface; loopback only for an endpoint that is itself loopback (every
"node" on one machine: tests). InfiniBand/RoCE: the HCAs with an active port, exactly, or
NCCL_IB_DISABLE=1 when there is none. A variable the user set is kept, and said so.

Pure given the facts: the only outside question is the endpoint's address, through `resolve`
(tests give their own).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence

from .findings import EnvFix, kept_or_set

IB_VARS = ("NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_NET")   # the user's own IB/transport choice
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def resolve_ipv4(host: str) -> list[str]:
    """The host's IPv4 addresses, [] when it does not resolve."""
    try:
        return list(dict.fromkeys(ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)))
    except (OSError, UnicodeError):
        return []


def link_facts_here() -> dict:
    """What nccl_link_fixes reads, for this machine, without the full (CUDA) machine query."""
    from .netfacts import query_net

    return {"host": {"hostname": socket.gethostname()}, "net": query_net()}


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _usable(net: dict) -> list[dict]:
    return [i for i in net.get("interfaces") or () if i.get("up") and not i.get("loopback") and i.get("ipv4")]


def _first_addr(iface: dict) -> str:
    return (iface.get("ipv4") or ["no IPv4 address"])[0]


def _short(host) -> str:
    """'gpu01.cluster' and 'GPU01' name the same machine."""
    return str(host or "").split(".")[0].lower()


def _default(net: dict) -> dict | None:
    name = net.get("default_route")
    return next((i for i in _usable(net) if i["name"] == name), None)


def socket_interface(facts: dict, endpoint_host: str | None, *,
                     resolve: Callable[[str], Sequence[str]] = resolve_ipv4) -> tuple[str | None, str]:
    """(interface name or None, why): the interface that reaches `endpoint_host`; with no
    endpoint, the one a multi-node job would use by default (the default route)."""
    net = facts.get("net") or {}
    interfaces = net.get("interfaces") or []
    default = _default(net)
    if endpoint_host is None:
        if default:
            return default["name"], f"{default['name']} ({_first_addr(default)}) has the default route"
        usable = _usable(net)
        if len(usable) == 1:
            return usable[0]["name"], f"{usable[0]['name']} ({_first_addr(usable[0])}) is the only interface up"
        return None, "no default route" + (", and several interfaces up" if usable else " and no interface up")
    literal = _ip(endpoint_host)
    addrs = [str(literal)] if literal is not None else list(resolve(endpoint_host))
    ips = [a for a in (_ip(x) for x in addrs) if a is not None and a.version == 4]
    shown = f" ({', '.join(map(str, ips))})" if literal is None and ips else ""
    where = f"the rendezvous endpoint {endpoint_host}{shown}"
    if (ips and all(a.is_loopback for a in ips)) or (literal is not None and literal.is_loopback):
        lo = next((i for i in interfaces if i.get("loopback")), {"name": "lo"})
        if literal is not None or endpoint_host.lower() in LOOPBACK_NAMES:
            return lo["name"], (f"{where} is loopback: every node runs on this machine (loopback is for "
                                "one-machine tests; give the first node's address for real nodes)")
        if default and _short(endpoint_host) == _short(facts.get("host", {}).get("hostname")):
            return default["name"], (f"{where} is this machine's own name, which resolves to loopback here "
                                     f"(/etc/hosts); the other nodes reach it over {default['name']} "
                                     f"({_first_addr(default)}), the default-route interface")
    best = None
    for iface in _usable(net):
        for cidr in iface["ipv4"]:
            try:
                subnet = ipaddress.ip_interface(cidr).network
            except ValueError:
                continue
            for a in ips:
                if a in subnet and (best is None or subnet.prefixlen > best[1].prefixlen):
                    best = (iface, subnet, cidr, a)
    if best:
        iface, _subnet, cidr, a = best
        target = endpoint_host if literal is not None else f"{endpoint_host} ({a})"
        return iface["name"], f"{iface['name']} ({cidr}) is on the subnet of the rendezvous endpoint {target}"
    if ips:
        why = f"no interface here is on {where}'s subnet"
    elif literal is not None:      # IPv6: only IPv4 subnets are recorded
        why = f"the rendezvous endpoint {endpoint_host} is IPv6 (hetrain matches IPv4 subnets only)"
    else:
        why = f"{endpoint_host} does not resolve here"
    if default:
        return default["name"], f"{why}; {default['name']} ({_first_addr(default)}) has the default route"
    return None, f"{why}, and there is no default route"


def _exact(names: Sequence[str]) -> str:
    return "=" + ",".join(names)   # NCCL: '=' asks for exactly these names, not every name they start


def ifname_matches(spec: str, names: Sequence[str]) -> list[str]:
    """The interfaces an NCCL_SOCKET_IFNAME value selects ('eth' prefixes, '=eth0' exact, '^' excludes)."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    parts = [p for p in (body[1:] if exact else body).split(",") if p]
    hit = (lambda n: n in parts) if exact else (lambda n: any(n.startswith(p) for p in parts))
    return [n for n in names if hit(n) != exclude]


def ib_setting(net: dict, iface: str | None) -> tuple[str, str, str]:
    """(var, value, why) for InfiniBand/RoCE."""
    over = f"sockets over {iface}" if iface else "TCP sockets"
    devices = net.get("ib") or []
    if not devices:
        return "NCCL_IB_DISABLE", "1", f"no InfiniBand/RoCE device here (/sys/class/infiniband): NCCL uses {over}"
    up_ifaces = {i["name"] for i in _usable(net)}
    active, idle = [], []
    for dev in devices:
        for port in dev.get("ports") or ():
            name = f"{dev['name']}:{port.get('port')}"
            roce = (port.get("link_layer") or "").lower() == "ethernet"
            if str(port.get("state")).upper() != "ACTIVE":
                idle.append(f"{name} {port.get('state') or 'state unknown'}")
            elif roce and dev.get("netdevs") and not up_ifaces & set(dev["netdevs"]):
                idle.append(f"{name} RoCE on {', '.join(dev['netdevs'])}, which is down or has no IPv4 address")
            else:
                active.append((name, f"{name} {port.get('link_layer') or 'link layer unknown'}"
                                     + (f" {port['rate']}" if port.get("rate") else "")))
    if not active:
        return "NCCL_IB_DISABLE", "1", (f"warning: InfiniBand/RoCE device(s) but no active port ({'; '.join(idle)}): "
                                        f"NCCL would try them and fail or stall, so it uses {over}; "
                                        "check the cables and `ibstat` to get InfiniBand's speed")
    left_out = f"; left out: {'; '.join(idle)}" if idle else ""
    return "NCCL_IB_HCA", _exact([n for n, _ in active]), (
        f"InfiniBand/RoCE ports active: {'; '.join(d for _, d in active)}{left_out}")


def nccl_link_fixes(facts: dict, *, endpoint_host: str, environ: Mapping[str, str],
                    resolve: Callable[[str], Sequence[str]] = resolve_ipv4) -> list[EnvFix]:
    """NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME, for hetrain's gloo groups) and the
    InfiniBand setting for a multi-node job whose rendezvous endpoint is `endpoint_host`.
    [] when the facts have no "net" section (recorded before it existed: unknown)."""
    net = facts.get("net")
    if not net:
        return []
    iface, why = socket_interface(facts, endpoint_host, resolve=resolve)
    fixes: list[EnvFix] = []
    if iface:
        nccl = kept_or_set("NCCL_SOCKET_IFNAME", _exact([iface]), why, environ)
        names = [i.get("name") for i in net.get("interfaces") or ()]
        if "NCCL_SOCKET_IFNAME" in environ and not ifname_matches(environ["NCCL_SOCKET_IFNAME"], names):
            nccl = EnvFix(nccl.var, nccl.value, f"{nccl.reason}; but it names no interface here "
                                                f"({', '.join(names)}): NCCL will find no socket interface")
        fixes.append(nccl)
        fixes.append(kept_or_set("GLOO_SOCKET_IFNAME", iface, "the same interface for hetrain's gloo groups "
                                 "(gloo otherwise binds the address this host's name resolves to, often "
                                 "127.0.1.1)", environ))
    user_ib = [v for v in IB_VARS if v in environ]
    if user_ib:       # the user chose the transport: keep all of it, add nothing to it
        fixes += [EnvFix(v, environ[v], f"{v}={environ[v]}: kept as you set it (InfiniBand/RoCE left to your "
                                        "settings)") for v in user_ib]
    else:
        fixes.append(kept_or_set(*ib_setting(net, iface), environ))
    return fixes
