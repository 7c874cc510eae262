"""GPU datasheet catalog: look a GPU up by what users type ('3090', 'a100-80g') or by what the
driver reports ('NVIDIA GeForce RTX 3090'). Data lives in gpus.toml beside this file.

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
    compute_capability: tuple[int, int]
    nvlink_gbs: float             # 0: no NVLink
    pcie_gen: int
    datacenter: bool
    speed_index: float            # relative training throughput, A100-80GB SXM = 1.0
    vendor: str = "nvidia"        # nvidia | amd | intel | huawei | cpu: devices of one vendor form an island
    device_type: str = "cuda"     # torch's device type: cuda (NVIDIA, and AMD through HIP) | hpu | xpu | npu | cpu
    backend: str = "nccl"         # the vendor's collective library as torch.distributed names it

    @property
    def real_bf16(self) -> bool:
        """bf16 in hardware (compute capability >= 8.0); below that torch runs it in software, slowly."""
        return self.compute_capability >= (8, 0)


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
        major, minor = (int(p) for p in str(d["compute_capability"]).split("."))
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
