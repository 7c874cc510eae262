"""One `Device` record per device, whatever it is: a CUDA GPU (torch.cuda + NVML), the CPU, or a
device of a planned cluster, named by a cluster spec (`ClusterDevice.to_device()`: catalog facts only).

Built from the machine description of `driver.py` (live or recorded); the catalog adds datasheet
facts. An unknown GPU keeps what the driver said (memory, compute capability) and carries a
'not in catalog' note instead of failing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import catalog
from .units import format_bytes

KINDS = ("cuda", "cpu", "planned")


@dataclass(frozen=True, kw_only=True)
class Device:
    kind: str                                   # 'cuda' | 'cpu' | 'planned'
    index: int                                  # cuda:N, a planned device's place in its spec, 0 for the CPU
    name: str                                   # as the driver reports it (or the catalog name)
    spec: catalog.GpuSpec | None = None         # datasheet facts; None: not in the catalog / not a GPU
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    nvml_index: int | None = None               # nvidia-smi's index (PCI bus order)
    visible: bool = True                        # torch can use it (not hidden, torch has CUDA)
    power_limit_w: float | None = None
    pcie_gen: int | None = None                 # current link generation (drops when idle)
    pcie_gen_max: int | None = None             # max of GPU and slot together
    pcie_gen_gpu_max: int | None = None         # the GPU's own max
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlink_active: int = 0
    numa_node: int | None = None
    utilization_pct: int | None = None
    h2d_gbs: float | None = None                # measured host-to-device copy bandwidth
    speed: float | None = None                  # planned: the spec's relative speed
    island: str = ""                            # planned: the cluster spec's island ('' : none named)
    source: str = ""                            # where the facts came from
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Device.kind {self.kind!r} is not one of {KINDS}")

    @property
    def label(self) -> str:
        if self.kind == "cuda":
            return f"cuda:{self.index}" if self.visible else f"gpu{self.nvml_index} (hidden)"
        return f"{self.spec.key}#{self.index}" if self.kind == "planned" else "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"

    @property
    def real_bf16(self) -> bool | None:
        """bf16 in hardware: compute capability >= 8.0 (torch's default check also counts bf16
        done in software, which passes on V100/T4 and is slow)."""
        if self.kind == "cpu":
            return None
        if self.spec is not None and self.spec.vendor != "nvidia":
            return self.spec.real_bf16      # no compute capability: the catalog's flag
        return self.compute_capability >= (8, 0) if self.compute_capability else None

    @property
    def vendor(self) -> str:
        """nvidia | amd | intel | huawei | cpu: the catalog's, else read off the driver's name."""
        if self.spec is not None:
            return self.spec.vendor
        if self.kind == "cpu":
            return "cpu"
        return "amd" if self.name.upper().startswith(("AMD", "RADEON")) else "nvidia"

    @property
    def datacenter(self) -> bool | None:
        return self.spec.datacenter if self.spec else None

    @property
    def in_catalog(self) -> bool:
        return self.spec is not None

    def summary(self) -> str:
        """'cuda:0 NVIDIA A100-SXM4-80GB, 80.0 GiB, cc 8.0'."""
        parts = [f"{self.label} {self.name}"]
        if self.memory_bytes:
            parts.append(format_bytes(self.memory_bytes))
        if self.compute_capability:
            parts.append("cc {}.{}".format(*self.compute_capability))
        return ", ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.key if self.spec else None
        d["label"] = self.label
        d["real_bf16"] = self.real_bf16
        d["vendor"] = self.vendor
        d["datacenter"] = self.datacenter
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        d["notes"] = list(self.notes)
        return d


def _not_in_catalog(name: str) -> str:
    return (f"{name!r} is not in hetrain's GPU catalog: memory and compute capability come from "
            "the driver; its speed is measured when training starts")


def gpu_from_record(g: dict, *, source: str) -> Device:
    """A GPU from one `gpus` entry of a machine description."""
    name = g.get("name") or "unknown GPU"
    spec = catalog.lookup(name)
    cc = tuple(g["compute_capability"]) if g.get("compute_capability") else None
    notes = [] if spec else [_not_in_catalog(name)]
    if spec and cc and cc != spec.compute_capability:
        notes.append(f"the driver reports compute capability {cc[0]}.{cc[1]}, the catalog "
                     f"{spec.compute_capability[0]}.{spec.compute_capability[1]}: using the driver's")
    visible = g.get("cuda_index") is not None
    return Device(
        kind="cuda", index=g["cuda_index"] if visible else (g.get("nvml_index") or 0), name=name,
        spec=spec, memory_bytes=g.get("memory_bytes") or (spec.memory_bytes if spec else None),
        compute_capability=cc or (spec.compute_capability if spec else None), uuid=g.get("uuid"),
        pci_bus_id=g.get("pci_bus_id"), nvml_index=g.get("nvml_index"), visible=visible,
        power_limit_w=g.get("power_limit_w"), pcie_gen=g.get("pcie_gen"),
        pcie_gen_max=g.get("pcie_gen_max"), pcie_gen_gpu_max=g.get("pcie_gen_gpu_max"),
        pcie_width=g.get("pcie_width"), pcie_width_max=g.get("pcie_width_max"),
        nvlink_active=g.get("nvlink_active") or 0, numa_node=g.get("numa_node"),
        utilization_pct=g.get("utilization_pct"), h2d_gbs=g.get("h2d_gbs"),
        source=source, notes=tuple(notes))


def cpu_device(facts: dict) -> Device:
    host = facts.get("host", {})
    cores = host.get("cpu_count")
    return Device(kind="cpu", index=0, name=host.get("cpu") or "CPU", source="host",
                  notes=(f"{cores} logical cores",) if cores else ())


def devices_from_facts(facts: dict) -> tuple[Device, ...]:
    """Every GPU of the machine description, or the CPU alone when there is none."""
    nvml = facts.get("nvml", {}).get("ok")
    cuda = facts.get("torch", {}).get("available")
    source = (facts.get("source", "live") if facts.get("source", "live") != "live"
              else " + ".join(s for s, ok in (("torch.cuda", cuda), ("NVML", nvml)) if ok) or "none")
    gpus = tuple(gpu_from_record(g, source=source) for g in facts.get("gpus", ()))
    return gpus or (cpu_device(facts),)


def from_cluster_device(d) -> Device:
    """A planned device (a `cluster.ClusterDevice`): catalog facts, the spec's speed and cap."""
    spec = d.gpu
    return Device(kind="planned", index=d.index, name=spec.name, spec=spec, memory_bytes=d.memory_bytes,
                  compute_capability=spec.compute_capability if spec.vendor == "nvidia" else None,
                  power_limit_w=spec.tdp_w, pcie_gen_gpu_max=spec.pcie_gen, speed=d.speed, island=d.island,
                  source=f"catalog, planned ({d.speed_source}; {d.memory_source})",
                  notes=("planned: a cluster spec's device, catalog facts only",))
