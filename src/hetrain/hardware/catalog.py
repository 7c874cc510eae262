"""Device datasheet catalog: look a GPU up by what users type ('3090', 'a100-80g') or by what the
driver reports ('NVIDIA GeForce RTX 3090'). Data lives in gpus.toml beside this file.

Beyond NVIDIA: AMD Instinct/Radeon (ROCm: torch device type `cuda` through HIP, RCCL as `nccl`),
Intel Gaudi (`hpu`, hccl), Intel Data Center GPU Max (`xpu`, xccl), Huawei Ascend (`npu`, hccl) and
a CPU socket (`cpu`, gloo). Compute capability is NVIDIA's: other entries carry (0, 0) and say
`bf16` in hardware explicitly (`real_bf16` reads it).

`lookup` returns None for an unknown GPU (callers degrade gracefully: memory and compute
capability from the driver, a 'not in catalog' note); `resolve` is for user input and raises a
UsageError that suggests close names.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass
from importlib import resources

from ..errors import UsageError, did_you_mean

GIB = 1024**3
VENDORS = ("nvidia", "amd", "intel", "huawei", "cpu")
DEVICE_TYPES = ("cuda", "hpu", "xpu", "npu", "cpu")


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    key: str                      # canonical alias, e.g. 'a100-80g'
    name: str                     # marketing name
    aliases: tuple[str, ...]
    names: tuple[str, ...]        # names the driver reports
    bf16_tflops: float            # dense tensor peak for mixed precision (0: no bf16 tensor path)
    fp16_tflops: float
    fp32_tflops: float
    memory_bytes: int
    bandwidth_gbs: float          # memory bandwidth, GB/s
    tdp_w: float
    compute_capability: tuple[int, int]   # NVIDIA's; (0, 0) for other vendors
    nvlink_gbs: float             # 0: no NVLink
    pcie_gen: int
    datacenter: bool
    speed_index: float            # relative training throughput, A100-80GB SXM = 1.0
    vendor: str = "nvidia"        # nvidia | amd | intel | huawei | cpu: devices of one vendor form an island
    device_type: str = "cuda"     # torch's device type: cuda (NVIDIA, and AMD through HIP) | hpu | xpu | npu | cpu
    backend: str = "nccl"         # the vendor's collective library as torch.distributed names it
    bf16: bool | None = None      # bf16 in hardware, given for non-NVIDIA (None: from compute capability)
    fp16: bool = True             # fp16 arithmetic in hardware (a CPU without it converts to fp32)
    fabric_gbs: float = 0.0       # the vendor's card-to-card link (xGMI, HCCS), both directions; 0: none

    @property
    def real_bf16(self) -> bool:
        """bf16 in hardware: NVIDIA's compute capability >= 8.0 (below that torch computes it
        slowly through fp32); other vendors' catalog flag."""
        return self.bf16 if self.bf16 is not None else self.compute_capability >= (8, 0)

    @property
    def precision_capability(self) -> tuple[int, int]:
        """The compute capability the precision rule reads: NVIDIA's own; for another vendor's
        device (8, 0) when it has bf16 in hardware, else (7, 0) (fp16 then, with a GradScaler)."""
        if self.vendor == "nvidia":
            return self.compute_capability
        return (8, 0) if self.real_bf16 else (7, 0)

    @property
    def collective(self) -> str:
        """The native collective library's own name ('rccl' for AMD, which torch calls nccl)."""
        return "rccl" if self.vendor == "amd" and self.backend == "nccl" else self.backend


def normalize(name: str) -> str:
    """'NVIDIA GeForce RTX 3090' and 'rtx-3090' both -> 'rtx3090'."""
    s = name.lower()
    for word in ("nvidia", "geforce", "tesla"):
        s = s.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", s)


@functools.cache
def all_gpus() -> tuple[GpuSpec, ...]:
    raw = tomllib.loads(resources.files(__package__).joinpath("gpus.toml").read_text())
    specs = []
    for key, d in raw.items():
        vendor = str(d.get("vendor", "nvidia"))
        if vendor not in VENDORS or str(d.get("device_type", "cuda")) not in DEVICE_TYPES:
            raise ValueError(f"gpus.toml [{key}]: vendor {vendor!r} / device_type {d.get('device_type')!r} unknown")
        if vendor != "nvidia" and "bf16" not in d:
            raise ValueError(f"gpus.toml [{key}]: a non-NVIDIA entry says bf16 = true/false (no compute capability)")
        major, minor = (int(p) for p in str(d.get("compute_capability", "0.0")).split("."))
        specs.append(GpuSpec(
            key=key, name=d["name"], aliases=tuple(d.get("aliases", ())),
            names=tuple(d.get("names", ())), bf16_tflops=float(d["bf16_tflops"]),
            fp16_tflops=float(d["fp16_tflops"]), fp32_tflops=float(d["fp32_tflops"]),
            memory_bytes=int(float(d["memory_gib"]) * GIB), bandwidth_gbs=float(d["bandwidth_gbs"]),
            tdp_w=float(d["tdp_w"]), compute_capability=(major, minor),
            nvlink_gbs=float(d.get("nvlink_gbs", 0)), pcie_gen=int(d["pcie_gen"]),
            datacenter=bool(d["datacenter"]), speed_index=float(d["speed_index"]),
            vendor=str(d.get("vendor", "nvidia")), device_type=str(d.get("device_type", "cuda")),
            backend=str(d.get("backend", "nccl")),
            bf16=bool(d["bf16"]) if "bf16" in d else None, fp16=bool(d.get("fp16", True)),
            fabric_gbs=float(d.get("fabric_gbs", 0)),
        ))
    return tuple(specs)


@functools.cache
def _index() -> dict[str, GpuSpec]:
    index: dict[str, GpuSpec] = {}
    for spec in all_gpus():
        for label in (spec.key, spec.name, *spec.aliases, *spec.names):
            index.setdefault(normalize(label), spec)
    return index


_MIG = re.compile(r"\s+MIG\s+\S+$", re.IGNORECASE)   # 'NVIDIA A100-SXM4-40GB MIG 1g.5gb'


def lookup(name: str) -> GpuSpec | None:
    """The catalog entry for an alias or a driver-reported name, or None when unknown.

    Matching is exact after normalising ('NVIDIA GeForce RTX 3090 Ti' is not a 3090): a wrong
    match would give the wrong speed and memory, an unknown GPU only a 'not in catalog' note.
    A MIG slice's name resolves to its parent card.
    """
    if not isinstance(name, str) or not name.strip():
        return None
    return _index().get(normalize(name)) or _index().get(normalize(_MIG.sub("", name.strip())))


def resolve(name: str) -> GpuSpec:
    """Like lookup, for user input: an unknown name is a UsageError naming close matches."""
    spec = lookup(name)
    if spec is None:
        known = sorted({s.key for s in all_gpus()} | {a for s in all_gpus() for a in s.aliases})
        raise UsageError(
            f"unknown GPU {name!r}{did_you_mean(name, known)}",
            "use a catalog name such as " + ", ".join(s.key for s in all_gpus()[:6])
            + " (`hetrain simulate --list-gpus` lists all)",
        )
    return spec
