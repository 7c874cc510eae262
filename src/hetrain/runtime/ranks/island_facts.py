"""A job's device islands, found from every rank's device at start.

Vendor collective libraries do not talk to each other, so ranks on different vendors' devices are
different islands: each runs its own library inside, and a host-staged bridge joins them. Every
rank says what its device is (`rank_device`: vendor, torch device type, backend, and for a
cluster spec's device the spec's island); `job_islands` turns the gathered table into one frozen
record, the same on every rank, from which the runtime builds its groups. Dependency-free: the
standard library and the errors module (torch only inside `rank_device`, when asked about a real
device).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ...errors import UsageError


@dataclass(frozen=True, kw_only=True)
class Island:
    name: str
    ranks: tuple[int, ...]
    vendor: str                  # nvidia | amd | intel | huawei | cpu
    device_type: str             # torch's: cuda (also AMD, through HIP) | hpu | xpu | npu | cpu
    backend: str                 # torch.distributed's name of its native library: nccl | hccl | xccl | gloo
    # the backend its groups run on where its ranks' tensors are on another device than its cards
    # (host tensors: a cluster spec's cards computing on the host CPU, gloo); '' : `backend`
    group_backend: str = ""

    @property
    def collective(self) -> str:
        """The library's own name: ROCm's RCCL is `nccl` to torch."""
        return "rccl" if self.vendor == "amd" and self.backend == "nccl" else self.backend


@dataclass(frozen=True, kw_only=True)
class JobIslands:
    islands: tuple[Island, ...]          # in order of their lowest rank
    bridge: str = ""                     # the link between islands as named ('host 25GbE'); '' : none known
    bridge_gbs: float | None = None      # its effective bandwidth, when a cluster spec gives it
    links_gbs: dict = field(default_factory=dict)   # island -> its own link's GB/s, where a spec names one
    # link(gbs, ring) -> what carries a collective over a link whose figures the spec gives (its
    # `run(collective, nbytes)`), where such links are modelled; None: collectives run on the wire
    link: Callable | None = None

    @property
    def multi(self) -> bool:
        return len(self.islands) > 1

    def island_of(self, rank: int) -> Island:
        return next(i for i in self.islands if rank in i.ranks)

    @property
    def leaders(self) -> tuple[int, ...]:
        """Each island's lowest rank, in island order."""
        return tuple(i.ranks[0] for i in self.islands)

    def describe(self) -> str:
        """'islands: nv = ranks 0,1 (nccl), amd = ranks 2,3 (rccl); bridge host 25GbE'."""
        parts = ", ".join(f"{i.name} = rank{'s' if len(i.ranks) > 1 else ''} {','.join(map(str, i.ranks))} "
                          f"({i.collective})" for i in self.islands)
        bridge = f"; bridge {self.bridge}" if self.bridge else ("; bridge gloo over host memory" if self.multi else "")
        return f"islands: {parts}{bridge}"


def default_name(vendor: str, device_type: str) -> str:
    """An island's name from its devices (hardware/islands.default_name's rule)."""
    if vendor == "intel":
        return "gaudi" if device_type == "hpu" else "xpu"
    return {"huawei": "ascend"}.get(vendor, vendor)


def rank_device(device=None, spec_device=None) -> dict:
    """This rank's device as the island table needs it. `spec_device`: a cluster spec's device
    (cluster.ClusterDevice: vendor and island from the spec); else `device`, the torch.device the
    rank trains on."""
    if spec_device is not None:
        g = spec_device.gpu
        return {"vendor": g.vendor, "device_type": g.device_type, "backend": g.backend, "island": spec_device.island}
    kind = getattr(device, "type", device) or "cpu"
    if kind == "cuda":
        import torch

        amd = getattr(torch.version, "hip", None) is not None
        return {"vendor": "amd" if amd else "nvidia", "device_type": "cuda", "backend": "nccl", "island": ""}
    vendor, backend = {"hpu": ("intel", "hccl"), "xpu": ("intel", "xccl"),
                       "npu": ("huawei", "hccl")}.get(kind, ("cpu", "gloo"))
    return {"vendor": vendor, "device_type": kind if vendor != "cpu" else "cpu", "backend": backend, "island": ""}


def job_islands(records: Sequence[Mapping], *, bridge: str = "", bridge_gbs: float | None = None,
                links_gbs: Mapping | None = None, held: Sequence[str] | None = None) -> JobIslands:
    """The job's islands from every rank's `rank_device` record (in rank order). A record's
    island name wins (a cluster spec's); unnamed ranks are grouped by vendor and device type. One
    island of two vendors, or islands named in a spec without a bridge, are UsageErrors naming it.
    `held`: per rank, the backend of the device its tensors are actually on (rank_device of the
    torch.device it trains on), where it may differ from its record's (Island.group_backend)."""
    names = [r.get("island") or "" for r in records]
    named = any(names)
    if not named:
        names = [default_name(r["vendor"], r["device_type"]) for r in records]
    order = list(dict.fromkeys(names))
    islands = []
    for name in order:
        ranks = tuple(i for i, n in enumerate(names) if n == name)
        kinds = {(records[i]["vendor"], records[i]["device_type"], records[i]["backend"]) for i in ranks}
        if len(kinds) > 1:
            side = "; ".join(f"rank {i} {records[i]['vendor']} {records[i]['device_type']}" for i in ranks)
            raise UsageError(f"island {name!r} mixes device vendors ({side}): their collective libraries "
                             "cannot share one group",
                             "give each vendor's devices their own island, joined by bridge=[host:]LINK")
        vendor, device_type, backend = kinds.pop()
        actual = {held[i] for i in ranks} if held else {backend}
        group_backend = actual.pop() if len(actual) == 1 and "" not in actual and backend not in actual else ""
        islands.append(Island(name=name, ranks=ranks, vendor=vendor, device_type=device_type, backend=backend,
                              group_backend=group_backend))
    if named and len(islands) > 1 and not bridge:
        raise UsageError(f"the job has {len(islands)} device islands ({', '.join(order)}) but no bridge between them",
                         "add bridge=[host:]LINK to the cluster spec, e.g. bridge=host:25GbE")
    return JobIslands(islands=tuple(islands), bridge=bridge, bridge_gbs=bridge_gbs, links_gbs=dict(links_gbs or {}))


def from_cluster(cluster, topology=None) -> JobIslands:
    """The islands of a parsed cluster spec's devices (one rank per device), without a gather."""
    records = [rank_device(spec_device=d) for d in cluster]
    bridge = getattr(topology, "bridge", None) if topology is not None else None
    return job_islands(records, bridge=bridge.name if bridge else "",
                       bridge_gbs=bridge.bandwidth_gbs if bridge else None)
