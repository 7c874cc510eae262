"""This machine's network, for the machine description's "net" section (hardware/driver.py): the
IP interfaces and the InfiniBand/RoCE devices a multi-node job's NCCL can use.

Read from the kernel, not from a driver: socket.if_nameindex and /sys/class/net for the
interfaces and their state, `ip -j addr` for the IPv4 addresses (an ioctl when `ip` is missing,
e.g. in a slim container), /proc/net/route for the default route, /sys/class/infiniband for the
HCAs and their ports. Every part can fail on some system (no /sys, no permission, no `ip`): a
failure becomes a note in net["errors"], never an exception, like the rest of the description.

The section:
  interfaces     one dict per interface: name, up (IFF_UP and not operstate down), loopback,
                 operstate, ipv4 ["10.0.0.5/24", ...]
  default_route  the interface of the lowest-metric default route, or None
  ib             one dict per HCA: name, netdevs (the IP interfaces of the same PCI function: the
                 RoCE netdev, or an IPoIB one), ports [{port, state, link_layer, rate}]
  errors         what could not be read
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
from pathlib import Path

IFF_UP, IFF_LOOPBACK = 0x1, 0x8
SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B     # linux/sockios.h
DOWN_STATES = ("down", "lowerlayerdown", "notpresent")


def query_net(*, root: str = "/") -> dict:
    """The "net" section for this machine (`root`: where /sys and /proc are, for tests)."""
    base = Path(root)
    errors: list[str] = []
    names = _interface_names(base, errors)
    addrs = _ipv4_by_ip_json(errors) if root == "/" and shutil.which("ip") else None
    if addrs is None:
        addrs = {n: _ipv4_by_ioctl(n) for n in names} if root == "/" else {}
    interfaces = []
    for name in names:
        sys_dir = base / "sys/class/net" / name
        flags = _read_int(sys_dir / "flags", 16)
        operstate = _read(sys_dir / "operstate") or "unknown"
        loopback = bool(flags is not None and flags & IFF_LOOPBACK) or name == "lo"
        up = (flags & IFF_UP != 0 if flags is not None else True) and operstate not in DOWN_STATES
        interfaces.append({"name": name, "up": bool(up), "loopback": loopback, "operstate": operstate,
                           "ipv4": addrs.get(name, [])})
    return {"interfaces": interfaces, "default_route": _default_route(base, errors),
            "ib": _ib_devices(base, errors), "errors": errors}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read(path)
    try:
        return int(text, base) if text else None
    except ValueError:
        return None


def _interface_names(base: Path, errors: list[str]) -> list[str]:
    if str(base) == "/":
        try:
            return [name for _i, name in socket.if_nameindex()]
        except OSError as e:
            errors.append(f"socket.if_nameindex: {e}")
    try:
        return sorted(p.name for p in (base / "sys/class/net").iterdir())
    except OSError as e:
        errors.append(f"/sys/class/net: {e}")
        return []


def _ipv4_by_ip_json(errors: list[str]) -> dict[str, list[str]] | None:
    """Every IPv4 address of every interface (`ip -j -4 addr`); None when `ip` fails."""
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, timeout=10)
        rows = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        errors.append(f"ip -j addr: {e}")
        return None
    if not isinstance(rows, list):
        errors.append(f"ip -j addr: exit {out.returncode}")
        return None
    found: dict[str, list[str]] = {}
    for row in rows:
        if isinstance(row, dict) and row.get("ifname"):
            found[row["ifname"]] = [f"{a['local']}/{a['prefixlen']}" for a in row.get("addr_info", ())
                                    if a.get("family") == "inet" and "local" in a and "prefixlen" in a]
    return found


def _ipv4_by_ioctl(name: str) -> list[str]:
    """The interface's primary IPv4 address (SIOCGIFADDR/SIOCGIFNETMASK), [] when it has none."""
    import fcntl

    request = struct.pack("256s", name.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24])
            mask = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, request)[20:24]
    except OSError:       # no address (EADDRNOTAVAIL), or the interface went away
        return []
    return [f"{addr}/{bin(int.from_bytes(mask, 'big')).count('1')}"]


def _default_route(base: Path, errors: list[str]) -> str | None:
    """The interface of the lowest-metric default IPv4 route in /proc/net/route."""
    text = _read(base / "proc/net/route")
    if text is None:
        errors.append("/proc/net/route: not readable")
        return None
    best = None
    for line in text.splitlines()[1:]:
        cols = line.split()
        try:
            iface, dest, flags, metric = cols[0], cols[1], int(cols[3], 16), int(cols[6])
        except (IndexError, ValueError):
            continue
        if dest == "00000000" and flags & 0x1 and (best is None or metric < best[1]):   # RTF_UP
            best = (iface, metric)
    return best[0] if best else None


def _ib_devices(base: Path, errors: list[str]) -> list[dict]:
    root = base / "sys/class/infiniband"
    if not root.exists():
        return []          # no HCA (or the driver is not loaded): what NCCL would see too
    devices = []
    try:
        for dev in sorted(root.iterdir()):
            ports = []
            for port in sorted((dev / "ports").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
                state = _read(port / "state") or "unknown"        # '4: ACTIVE'
                ports.append({"port": int(port.name) if port.name.isdigit() else port.name,
                              "state": state.split(":", 1)[-1].strip(),
                              "link_layer": _read(port / "link_layer"), "rate": _read(port / "rate")})
            try:
                netdevs = sorted(p.name for p in (dev / "device/net").iterdir())
            except OSError:
                netdevs = []
            devices.append({"name": dev.name, "netdevs": netdevs, "ports": ports})
    except OSError as e:
        errors.append(f"/sys/class/infiniband: {e}")
    return devices

