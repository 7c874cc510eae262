"""Links between GPUs: what connects each pair (NVLink, a PCIe switch, the CPU, two sockets),
whether peer-to-peer copies work, and how fast a gradient can move between them.

Link codes are nvidia-smi's (`nvidia-smi topo -m`): NV# (# NVLinks), PIX (one PCIe switch), PXB
(several switches), PHB (a PCIe host bridge, i.e. through the CPU), NODE (host bridges within one
NUMA node), SYS (across CPU sockets, over QPI/UPI/Infinity Fabric).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .devices import Device

KINDS = {"PIX": "pcie-switch", "PXB": "pcie-switches", "PHB": "host-bridge", "NODE": "same-socket",
         "SYS": "cross-socket", "INT": "same-board"}
# PCIe: GB/s per lane per direction after line coding (gen1-2 8b/10b, gen3+ 128b/130b).
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# NVLink: GB/s per link per direction by generation, keyed by the lower compute capability.
# (NVLink 1 on P100: 20; NVLink 2-4 on V100/A100/H100: 25; GA102 bridges (3090, A6000, A40): 14.06.)


def nvlink_link_gbs(cc: tuple[int, int] | None) -> float | None:
    if cc is None:
        return None
    if cc < (7, 0):
        return 20.0
    if cc in ((8, 6), (8, 9)):
        return 14.0625
    return 25.0


@dataclass(frozen=True, kw_only=True)
class Link:
    a: int                          # positions in the device list
    b: int
    code: str | None                # nvidia-smi code (NV12, PIX, SYS, ...); None: unknown (no NVML)
    kind: str                       # 'nvlink', 'pcie-switch', 'host-bridge', 'same-socket', 'cross-socket', 'unknown'
    nvlinks: int
    p2p_reported: bool | None       # torch.cuda.can_device_access_peer, both ways
    p2p_verified: bool | None       # a copied tensor arrived intact (None: not tried)
    p2p_error: str | None
    estimated_gbs: float | None     # peak one-direction bandwidth from link facts
    estimate_basis: str
    measured_gbs: float | None      # with --measure: a 256 MiB copy

    @property
    def p2p_broken(self) -> bool:
        return bool(self.p2p_reported) and self.p2p_verified is False

    def to_dict(self) -> dict:
        return asdict(self)


def _pcie_gbs(d: Device) -> float | None:
    # The max generation, not the current one: idle GPUs drop their link to gen1 to save power.
    gen = d.pcie_gen_max or (d.spec.pcie_gen if d.spec else None)
    width = d.pcie_width or d.pcie_width_max or 16
    return PCIE_LANE_GBS.get(gen, 0) * width if gen else None


def _estimate(a: Device, b: Device, code: str | None, nvlinks: int, p2p: bool | None) -> tuple[float | None, str]:
    if nvlinks:
        ccs = [d.compute_capability for d in (a, b) if d.compute_capability]
        per = nvlink_link_gbs(min(ccs) if ccs else None)
        if per:
            return round(per * nvlinks, 1), f"{nvlinks} NVLink(s) x {per:g} GB/s per direction"
    ends = [g for g in (_pcie_gbs(a), _pcie_gbs(b)) if g]
    if not ends:
        return None, "unknown (no PCIe link facts)"
    slow = min(ends)
    via = "" if p2p else "; without P2P, copies are staged through host memory"
    where = " over the CPU interconnect" if code == "SYS" else ""
    return round(slow, 1), f"PCIe peak of the slower end{where}{via}"


def links(devices: tuple[Device, ...], facts: dict) -> tuple[Link, ...]:
    """One Link per GPU pair in the machine description."""
    out = []
    for p in facts.get("pairs", ()):
        a, b = devices[p["a"]], devices[p["b"]]
        nvlinks = p.get("nvlinks") or 0
        code = p.get("level")
        kind = "nvlink" if nvlinks else KINDS.get(code, "unknown")
        est, basis = _estimate(a, b, code, nvlinks, p.get("p2p_reported"))
        out.append(Link(a=p["a"], b=p["b"], code=code, kind=kind, nvlinks=nvlinks,
                        p2p_reported=p.get("p2p_reported"), p2p_verified=p.get("p2p_verified"),
                        p2p_error=p.get("p2p_error"), estimated_gbs=est, estimate_basis=basis,
                        measured_gbs=p.get("measured_gbs")))
    return tuple(out)


def matrix(devices: tuple[Device, ...], all_links: tuple[Link, ...]) -> list[list[str]]:
    """nvidia-smi-style table: header row, then one row per GPU (X on the diagonal).
    Each cell: link code, then P2P as ok / NO / BROKEN / ? (not checked)."""
    gpus = [d for d in devices if d.kind == "cuda"]
    if len(gpus) < 2:
        return []
    cell = {}
    for ln in all_links:
        p2p = ("BROKEN" if ln.p2p_broken else "ok" if ln.p2p_verified else
               "NO" if ln.p2p_reported is False else "?")
        cell[(ln.a, ln.b)] = cell[(ln.b, ln.a)] = f"{ln.code or '?'} p2p:{p2p}"
    rows = [[""] + [d.label for d in gpus]]
    for i, d in enumerate(gpus):
        rows.append([d.label] + ["X" if i == j else cell.get((i, j), "?") for j in range(len(gpus))])
    return rows
