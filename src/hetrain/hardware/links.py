"""Links named in a cluster spec: `nvlink`, `pcie4`, `25GbE`, `ib-hdr`, or a number with a unit.

A link's figure here is its *effective* bandwidth for a ring collective (what NCCL's bus bandwidth
reaches), not the line rate printed on the box:

  nvlink          the node's card's NVLink figure (catalog) × NVLINK_EFFICIENCY
  xgmi, hccs      AMD's Infinity Fabric (xGMI) and Huawei's HCCS between an island's cards: the
                  catalog's fabric_gbs × FABRIC_EFFICIENCY
  pcie3/4/5       PCIE_GBS: ~75% of a x16 slot's 16/32/64 GB/s
  10GbE ... 400GbE, ib-edr/hdr/ndr
                  NETWORK_EFFICIENCY of the line rate (framing, TCP or RDMA overheads)
  12GB/s, 100Gb/s, 25Gbit, 800MB/s, 40Gbps
                  a number with a unit is taken as the effective bandwidth, as given

Units: B for bytes, b/bit for bits (`GB/s` is bytes, `Gb/s` and `Gbit` are bits); prefixes K, M, G,
T are powers of 1000, Ki/Mi/Gi/Ti of 1024. Names are case-insensitive; a unit's B/b is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError, did_you_mean
from .catalog import GpuSpec

# Effective all-reduce bus bandwidth of a PCIe x16 slot, GB/s (~75% of the 16/32/64 GB/s link).
PCIE_GBS = {3: 12.0, 4: 24.0, 5: 48.0}
NVLINK_EFFICIENCY = 0.4              # NCCL bus bandwidth / catalog NVLink figure (A100: ~240 of 600)
# RCCL/HCCL bus bandwidth over the card fabric: taken as NVLink's ratio (an order of magnitude;
# the profiler measures the real one)
FABRIC_EFFICIENCY = 0.4
FABRICS = {"xgmi": ("amd", "Infinity Fabric (xGMI)"), "hccs": ("huawei", "HCCS")}
NETWORK_EFFICIENCY = 0.9             # of a NIC's line rate, reached by large all-reduce messages
RING_HOP_LATENCY_S = 10e-6           # per ring step on NVLink/PCIe (NCCL, order of magnitude)
ETHERNET_HOP_LATENCY_S = 50e-6       # per ring step over TCP (through both kernels), order of magnitude
IB_HOP_LATENCY_S = 10e-6             # per ring step over InfiniBand RDMA, order of magnitude
# Line rates in Gbit/s of the network links known by name.
NETWORK_GBIT = {"1gbe": 1, "10gbe": 10, "25gbe": 25, "40gbe": 40, "50gbe": 50, "100gbe": 100,
                "200gbe": 200, "400gbe": 400, "ib-edr": 100, "ib-hdr": 200, "ib-ndr": 400}
NAMES = ("nvlink", "xgmi", "hccs", "pcie3", "pcie4", "pcie5", *("1GbE", "10GbE", "25GbE", "40GbE", "50GbE", "100GbE",
                                                "200GbE", "400GbE", "ib-edr", "ib-hdr", "ib-ndr"))
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1024.0, "mi": 1024.0**2,
           "gi": 1024.0**3, "ti": 1024.0**4}
_NUMBER = re.compile(r"^(?P<num>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>.*)$", re.IGNORECASE)
_UNIT = re.compile(r"^(?P<prefix>[kKmMgGtT]i?)?(?:(?P<bytes>B)(?:/s|ps)?|(?P<bits>b|bit)(?:/s|ps)?|(?P<bps>bps))$")
UNITS = "GB/s, MB/s, GiB/s (bytes) or Gb/s, Gbit, Gbps, Mb/s (bits)"


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A link as a cluster spec names it: its effective bandwidth and per-hop latency, and what was
    written (`name`) and why the figure is what it is (`source`)."""

    name: str
    bandwidth_gbs: float
    latency_s: float
    source: str


def bad_link(text: str, where: str, why: str) -> UsageError:
    return UsageError(f"link {text!r} {where}: {why}",
                      f"write a link as one of {', '.join(NAMES)}, or a number with a unit ({UNITS}), "
                      "e.g. node0=2xa100-80g/nvlink; node1=4xrtx3090/12GB/s; net=25GbE")


def parse_link(text: str, *, where: str, gpus: tuple[GpuSpec, ...] = ()) -> LinkSpec:
    """A link named in a cluster spec (`where` says which item, for the error); `gpus`: the cards
    of the node the link joins (nvlink's figure comes from them)."""
    s = text.strip()
    key = s.lower()
    if not s:
        raise bad_link(text, where, "the link is empty")
    if key == "nvlink":
        return _nvlink(s, where, gpus)
    if key in FABRICS:
        return _fabric(s, key, where, gpus)
    if re.fullmatch(r"pcie[345]", key):
        gen = int(key[-1])
        return LinkSpec(name=s, bandwidth_gbs=PCIE_GBS[gen], latency_s=RING_HOP_LATENCY_S,
                        source=f"PCIe {gen}.0 x16 ≈ {PCIE_GBS[gen]:g} GB/s effective")
    if key in NETWORK_GBIT:
        gbit = NETWORK_GBIT[key]
        gbs = gbit / 8 * NETWORK_EFFICIENCY
        latency = IB_HOP_LATENCY_S if key.startswith("ib-") else ETHERNET_HOP_LATENCY_S
        return LinkSpec(name=s, bandwidth_gbs=gbs, latency_s=latency,
                        source=f"{s}: {NETWORK_EFFICIENCY:.0%} of {gbit:g} Gbit/s ≈ {gbs:.3g} GB/s effective")
    m = _NUMBER.match(s)
    if not m:
        raise bad_link(text, where, "not a known link name" + did_you_mean(s, list(NAMES)))
    unit = _UNIT.match(m["unit"].strip())
    if not unit:
        raise bad_link(text, where, f"the unit {m['unit'].strip() or '(none)'!r} is not understood")
    per_s = float(m["num"]) * _PREFIX[(unit["prefix"] or "").lower()]
    gbs = per_s / 1e9 if unit["bytes"] else per_s / 8e9
    if not 0 < gbs <= 100_000:
        raise bad_link(text, where, "the bandwidth must be positive and at most 100 TB/s")
    return LinkSpec(name=s, bandwidth_gbs=gbs, latency_s=RING_HOP_LATENCY_S, source=f"{s} as given ({gbs:.3g} GB/s)")


def _nvlink(text: str, where: str, gpus: tuple[GpuSpec, ...]) -> LinkSpec:
    if not gpus:
        raise bad_link(text, where, "nvlink joins the cards of one node, not nodes")
    other = sorted({g.vendor for g in gpus if g.vendor != "nvidia"})
    if other:
        fabric = next((k for k, (v, _) in FABRICS.items() if v in other), "pcie4")
        raise bad_link(text, where, f"NVLink is NVIDIA's; these are {', '.join(other)} devices (use {fabric})")
    without = sorted({g.key for g in gpus if g.nvlink_gbs <= 0})
    if without:
        raise bad_link(text, where, f"{', '.join(without)} has no NVLink in the catalog")
    if len({g.key for g in gpus}) > 1:
        raise bad_link(text, where, "NVLink does not bridge different card models")
    g = gpus[0]
    gbs = g.nvlink_gbs * NVLINK_EFFICIENCY
    return LinkSpec(name=text, bandwidth_gbs=gbs, latency_s=RING_HOP_LATENCY_S,
                    source=f"NVLink between {g.key} cards: {NVLINK_EFFICIENCY:.0%} of {g.nvlink_gbs:g} GB/s")


def _fabric(text: str, key: str, where: str, gpus: tuple[GpuSpec, ...]) -> LinkSpec:
    vendor, label = FABRICS[key]
    if not gpus:
        raise bad_link(text, where, f"{key} joins the cards of one machine, not machines")
    wrong = sorted({g.key for g in gpus if g.vendor != vendor or g.fabric_gbs <= 0})
    if wrong:
        raise bad_link(text, where, f"{', '.join(wrong)} has no {label} in the catalog")
    if len({g.key for g in gpus}) > 1:
        raise bad_link(text, where, f"{label} does not join different card models")
    g = gpus[0]
    gbs = g.fabric_gbs * FABRIC_EFFICIENCY
    return LinkSpec(name=text, bandwidth_gbs=gbs, latency_s=RING_HOP_LATENCY_S,
                    source=f"{label} between {g.key} cards: {FABRIC_EFFICIENCY:.0%} of {g.fabric_gbs:g} GB/s")
