"""Device islands on one machine: `nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi; bridge=host:25GbE`.

Vendor collective libraries do not talk to each other (NCCL and RCCL in one ring fail), so a job
that mixes vendors runs each vendor's library inside its island and a host-staged bridge (gloo on
host memory) between islands. Grammar (the cluster spec's island form, hardware/cluster.py):

    ISLAND=DEVICES[/LINK]; ISLAND=DEVICES[/LINK]; ...; bridge=[host:]LINK
  ISLAND  a name, as a node's (a letter or digit, then letters, digits, '-', '_', '.'); not 'net' or
          'bridge'; each once. Its devices share one vendor and torch device type.
  DEVICES the island's devices in the flat grammar (comma separated, COUNTxNAME[:SPEED][@MEMORY])
  LINK    after DEVICES: the link inside the island (nvlink, xgmi, hccs, pcie4, 12GB/s, ...);
          after `bridge=`: the link between islands. `host:` says it is staged through host memory
          (every bridge is); `bridge=host` alone is host memory over the cards' own PCIe slots.
          Needed with two islands or more.
A flat spec with `cpu` items (`2xa100-80g,cpu`) is two islands: the CPU and the cards (named by
vendor: 'nvidia', 'amd', 'gaudi', 'xpu', 'ascend', 'cpu'), bridged by host memory over the cards'
PCIe. A flat spec mixing two GPU vendors is an error: name the islands and the bridge.

Islands are the devices of one machine; the nodes form (`node0=...; net=...`) stays the
multi-node one, and the two do not mix.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import UsageError
from . import catalog
from .links import PCIE_GBS, RING_HOP_LATENCY_S, LinkSpec, parse_link

EXAMPLE = "nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi; bridge=host:25GbE"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
RESERVED = ("net", "bridge")


@dataclass(frozen=True, kw_only=True)
class Island:
    """One island of a cluster spec: its devices (indices into the spec's devices), its link, and
    the vendor, torch device type and collective library its devices share."""

    name: str
    devices: tuple[int, ...]
    part: str                    # its devices in the flat grammar
    link: LinkSpec | None        # None: from the catalog
    vendor: str
    device_type: str
    backend: str


def default_name(gpu: catalog.GpuSpec) -> str:
    """An island's name where the spec gives none: the vendor, or the product line for Intel
    (Gaudi and XPU devices are different islands) and Huawei."""
    if gpu.vendor == "intel":
        return "gaudi" if gpu.device_type == "hpu" else "xpu"
    return {"huawei": "ascend"}.get(gpu.vendor, gpu.vendor)


def is_island_spec(spec: str) -> bool:
    """The spec names a bridge: the island form (the nodes form names net=)."""
    return any(p.partition("=")[0].strip().lower() == "bridge" for p in spec.split(";") if "=" in p)


def bad_island(item: str, why: str) -> UsageError:
    return UsageError(f"bad island {item!r} in cluster spec: {why}",
                      "write islands as ISLAND=DEVICES[/LINK] items, one vendor each, and the link between "
                      f"them as bridge=[host:]LINK, separated by ';', e.g. {EXAMPLE}")


def mixed_vendors(gpus, where: str, *, spec: str) -> UsageError:
    """The error for one island (or a flat spec) holding two vendors' devices."""
    kinds = {}
    for g in gpus:
        kinds.setdefault(default_name(g), []).append(g.key)
    side = "; ".join(f"{k}: {', '.join(dict.fromkeys(v))}" for k, v in kinds.items())
    example = "; ".join(f"{k}={','.join(v)}" for k, v in kinds.items()) + "; bridge=host:25GbE"
    return UsageError(f"{where} mixes device vendors ({side}): their collective libraries cannot share one group",
                      f"give each vendor its own island and a bridge between them, e.g. {example!r} "
                      f"(cluster spec {spec.strip()!r})")


def host_bridge(text: str, gpus: tuple[catalog.GpuSpec, ...]) -> LinkSpec:
    """`bridge=host`: device-to-host copies over the slowest card's own PCIe slot."""
    cards = [g for g in gpus if g.device_type != "cpu"] or list(gpus)
    gen = min(g.pcie_gen for g in cards)
    gbs = PCIE_GBS.get(gen, PCIE_GBS[3])
    return LinkSpec(name=text, bandwidth_gbs=gbs, latency_s=RING_HOP_LATENCY_S,
                    source=f"host memory over the cards' PCIe {gen}.0 x16 ≈ {gbs:g} GB/s effective")


def parse_bridge(text: str, gpus: tuple[catalog.GpuSpec, ...]) -> LinkSpec:
    """`[host:]LINK` or `host`: the link between islands (its name keeps what was written)."""
    s = text.strip()
    head, colon, rest = s.partition(":")
    if s.lower() == "host":
        return host_bridge(s, gpus)
    if colon and head.strip().lower() == "host":
        link = parse_link(rest, where="between islands (bridge=)")
    else:
        link = parse_link(s, where="between islands (bridge=)")
    return LinkSpec(name=f"host {link.name}", bandwidth_gbs=link.bandwidth_gbs, latency_s=link.latency_s,
                    source=f"staged through host memory; {link.source}")


def check_one_vendor(gpus, where: str, spec: str) -> None:
    if len({(g.vendor, g.device_type, g.backend) for g in gpus}) > 1:
        raise mixed_vendors(gpus, where, spec=spec)


def flat_islands(gpus: tuple[catalog.GpuSpec, ...], spec: str) -> tuple[list[str], LinkSpec | None]:
    """A flat spec's islands: ([''] * n, None) for one vendor; the CPU items as island 'cpu' beside
    the cards' island (bridged by host memory); two GPU vendors are an error."""
    cards = [g for g in gpus if g.vendor != "cpu"]
    check_one_vendor(cards, "the cluster spec", spec)
    if not cards or len(cards) == len(gpus):
        return [""] * len(gpus), None
    return [default_name(g) for g in gpus], host_bridge("host", tuple(gpus))


def parse_islands(spec: str, devices_of, build):
    """The island form's devices and topology (`devices_of(part, before)` and `build(raw, islands)`
    are cluster.py's flat-grammar helpers). Returns (devices, islands, bridge, flat)."""
    raw: list = []
    islands: list[Island] = []
    bridge_text: str | None = None
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue
        name, eq, body = (p.strip() for p in item.partition("="))
        if not eq:
            raise bad_island(item, "an item without ISLAND= (in the island form every item is "
                                   "ISLAND=DEVICES or bridge=LINK)")
        if name.lower() == "bridge":
            if bridge_text is not None:
                raise bad_island(item, "bridge= is given twice")
            bridge_text = body
            continue
        if name.lower() == "net":
            raise bad_island(item, "net= joins nodes; islands are on one machine and joined by bridge= "
                                   "(drop net=, or write the nodes form without bridge=)")
        if not _NAME.match(name):
            raise bad_island(item, f"the island name {name!r} is not a letter or digit followed by letters, "
                                   "digits, '-', '_' or '.'")
        if any(i.name.lower() == name.lower() for i in islands):
            raise bad_island(item, f"the island {name!r} is named twice")
        part, slash, link = (p.strip() for p in body.partition("/"))
        if not part:
            raise bad_island(item, "the island names no devices")
        mine = devices_of(part, len(raw))
        gpus = tuple(g for g, _, _ in mine)
        check_one_vendor(gpus, f"island {name!r}", spec)
        link_spec = parse_link(link, where=f"of island {name!r}", gpus=gpus) if slash else None
        g = gpus[0]
        islands.append(Island(name=name, devices=tuple(range(len(raw), len(raw) + len(mine))), part=part,
                              link=link_spec, vendor=g.vendor, device_type=g.device_type, backend=g.backend))
        raw.extend(mine)
    if not islands:
        raise bad_island(spec.strip(), "no island is named")
    all_gpus = tuple(g for g, _, _ in raw)
    bridge = parse_bridge(bridge_text, all_gpus) if bridge_text is not None and bridge_text.strip() else None
    if bridge_text is not None and bridge is None:
        raise bad_island(spec.strip(), "bridge= names no link")
    names = [next(i.name for i in islands if d in i.devices) for d in range(len(raw))]
    return build(raw, names), tuple(islands), bridge, ",".join(i.part for i in islands)


def no_bridge(spec: str, groups: dict[str, list]) -> UsageError:
    """Two islands (or two vendors' nodes) with no link between them."""
    return UsageError(f"cluster spec {spec.strip()!r} has {len(groups)} device islands "
                      f"({', '.join(groups)}) but no bridge between them",
                      f"add bridge=[host:]LINK, e.g. {EXAMPLE} (bridge=host: host memory over the cards' PCIe)")


# What a real run needs from torch for each device type: the module that provides it, and the fix.
PLUGINS = {
    "hpu": ("habana_frameworks.torch", "Intel Gaudi devices (hpu)",
            "install Intel Gaudi's PyTorch (the habana-torch-plugin of the Gaudi software stack, or its "
            "container image vault.habana.ai/gaudi-docker) and run there"),
    "npu": ("torch_npu", "Huawei Ascend devices (npu)",
            "pip install torch-npu matching this torch (with the CANN toolkit installed), or use Ascend's "
            "PyTorch container image"),
    "xpu": (None, "Intel Data Center GPUs (xpu)",
            "install a torch build for XPU: pip install torch --index-url https://download.pytorch.org/whl/xpu"),
}


def torch_cannot_use(device_type: str) -> str | None:
    """Why this torch cannot drive `device_type` for a real run (None: it can, or the type needs
    nothing beyond torch: cuda and cpu are the job's own checks)."""
    import importlib.util

    import torch

    if device_type not in PLUGINS:
        return None
    module, what, _ = PLUGINS[device_type]
    if module is not None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{what} need {module}, which is not installed beside torch {torch.__version__}"
        return None
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not xpu.is_available():
        return f"torch {torch.__version__} has no usable XPU support (torch.xpu.is_available() is False)"
    return None


def present_accelerators(root: str = "/") -> dict[str, str]:
    """Accelerators whose driver this machine has loaded, by torch device type: {'hpu': where}.
    Gaudi: the habanalabs driver's accel devices; Ascend: /dev/davinciN. (AMD cards answer to a
    ROCm torch's torch.cuda, checked by the job itself.)"""
    found: dict[str, str] = {}
    accel = os.path.join(root, "sys/class/accel")
    try:
        for entry in sorted(os.listdir(accel)):
            driver = os.path.join(accel, entry, "device/driver")
            if os.path.basename(os.path.realpath(driver)) == "habanalabs":
                found.setdefault("hpu", f"/dev/accel/{entry} (habanalabs driver)")
    except OSError:
        pass
    try:
        davinci = sorted(e for e in os.listdir(os.path.join(root, "dev")) if re.fullmatch(r"davinci\d+", e))
    except OSError:
        davinci = []
    if davinci:
        found["npu"] = f"/dev/{davinci[0]}"
    return found


def check_real_devices(root: str = "/") -> None:
    """Before a run on this machine's own devices that torch would put on the CPU: accelerators that this
    torch cannot drive are one UsageError line with the install that fixes it."""
    for device_type, where in present_accelerators(root).items():
        why = torch_cannot_use(device_type)
        if why:
            raise UsageError(f"this machine has {where}, but {why}: the job would run on the CPU",
                             PLUGINS[device_type][2] + "; or, to train on the CPU on purpose, pass --nproc N")


def describe_islands(parsed) -> str | None:
    """'islands: nv = a100-80g#0,a100-80g#1 (nccl), amd = mi300x#2,mi300x#3 (rccl); bridge host 25GbE'
    for a parsed cluster spec (cluster.ClusterSpec) of several islands (None for one)."""
    names = list(dict.fromkeys(d.island for d in parsed.devices))
    if len(names) < 2:
        return None
    parts = []
    for name in names:
        mine = [d for d in parsed.devices if d.island == name]
        parts.append(f"{name} = {','.join(d.label for d in mine)} ({mine[0].gpu.collective})")
    bridge = parsed.topology.bridge
    return "islands: " + ", ".join(parts) + (f"; bridge {bridge.name} ({bridge.source})" if bridge else "")


def device_islands(devices) -> list[str]:
    """Each `devices.Device`'s island for display: the spec's name, else (a machine mixing
    vendors) its vendor's island name, else '-' (one island)."""
    named = [d.island for d in devices]
    if any(named):
        return [n or "-" for n in named]
    kinds = {(d.vendor, d.spec.device_type if d.spec else "cuda") for d in devices}
    if len(kinds) < 2:
        return ["-"] * len(devices)
    return [_vendor_island(d) for d in devices]


def _vendor_island(d) -> str:
    if d.spec is not None:
        return default_name(d.spec)
    return d.vendor


def join_node_items(items: list[str], *, bridge: str = "host") -> str:
    """A multi-node job's cluster spec from every rank's device item ('a100-80g:1.0@40MiB'), in
    rank order: flat when the nodes share a vendor (or add only the CPU), else the island form
    with one island per vendor (each a run of consecutive ranks) and `bridge`."""
    flat = ",".join(items)
    gpus = [catalog.resolve(re.split(r"[:@]", item, maxsplit=1)[0].strip()) for item in items]
    if len({default_name(g) for g in gpus if g.vendor != "cpu"}) < 2:
        return flat
    runs: list[tuple[str, list[str]]] = []
    for g, item in zip(gpus, items):
        name = default_name(g)
        if runs and runs[-1][0] == name:
            runs[-1][1].append(item)
        elif any(n == name for n, _ in runs):
            raise UsageError(f"the job's {name} devices are not consecutive ranks ({flat})",
                             "order the nodes so that each vendor's devices come together (their --node-rank)")
        else:
            runs.append((name, [item]))
    return "; ".join(f"{n}={','.join(i)}" for n, i in runs) + f"; bridge={bridge}"
