"""`hetrain env`: a paste-ready report for bug reports, like `python -m torch.utils.collect_env`
but with every GPU (UUID, bus id, compute capability, memory, power, PCIe, NVLink), the link and
peer-to-peer matrix, and the environment variables that change NCCL/CUDA behaviour.
"""

from __future__ import annotations

from .machine import Machine
from .topology import matrix
from .units import format_bytes

HEADER = ("Copy-and-paste the text below in your GitHub issue. For torch's own report, also run "
          "`python -m torch.utils.collect_env`.")


def _val(x) -> str:
    return "unknown" if x is None or x == "" else str(x)


def _gpu_lines(d, island: str = "-") -> list[str]:
    cc = "{}.{}".format(*d.compute_capability) if d.compute_capability else "unknown"
    kind = f"{d.spec.device_type}, {d.spec.collective}" if d.spec else "cuda"
    lines = [f"- {d.label}: {d.name}" + ("" if d.visible else " (not visible to torch)"),
             f"    vendor: {d.vendor} (torch device type and library: {kind}); island: {island}",
             f"    catalog: {d.spec.key if d.spec else 'not in catalog'}; compute capability {cc}; "
             f"bf16 in hardware: {'yes' if d.real_bf16 else 'no' if d.real_bf16 is False else 'unknown'}",
             f"    memory: {format_bytes(d.memory_bytes) if d.memory_bytes else 'unknown'}; "
             f"power limit: {f'{d.power_limit_w:.0f} W' if d.power_limit_w else 'unknown'}"]
    if d.kind == "planned":
        lines.append(f"    planned: speed {d.speed:.2f}; {d.source}")
        return lines
    lines.append(f"    uuid: {_val(d.uuid)}; PCI bus id: {_val(d.pci_bus_id)}; nvidia-smi index: "
                 f"{_val(d.nvml_index)}; NUMA node: {_val(d.numa_node)}")
    if d.pcie_width_max:
        lines.append(f"    PCIe: gen{_val(d.pcie_gen)} x{_val(d.pcie_width)} now, gen{_val(d.pcie_gen_max)} "
                     f"x{_val(d.pcie_width_max)} max (card gen{_val(d.pcie_gen_gpu_max)}); "
                     f"NVLinks active: {d.nvlink_active}")
    if d.h2d_gbs:
        lines.append(f"    host-to-device copy: {d.h2d_gbs} GB/s (measured)")
    lines += [f"    note: {n}" for n in d.notes]
    return lines


def _cpu_precision_lines(recorded: dict | None) -> list[str]:
    """The CPU as a compute device (no GPU): native bf16/fp16 and the measured slowdowns."""
    from .host import HostFacts

    if not recorded:
        return []
    try:
        host = HostFacts.from_dict(recorded)
    except (ValueError, TypeError, KeyError):
        return [f"- CPU precision: unknown ({recorded.get('error', 'unreadable record')})"]
    return [f"- CPU precision: {host.describe()}; flags: {' '.join(host.flags) or 'none of the SIMD ones'}",
            "  one thread, ms fp32/bf16/fp16: block "
            + "/".join(f"{host.block_ms.get(p, 0):.1f}" for p in ("fp32", "bf16", "fp16"))
            + ", matmul " + "/".join(f"{host.matmul_ms.get(p, 0):.2f}" for p in ("fp32", "bf16", "fp16"))
            + f" [{host.source}]",
            f"  precision rule: {host.precision_meaning()}"]


def render_text(m: Machine, rank_versions: tuple[dict, ...] | None = None) -> str:
    """The report; `rank_versions` (under torchrun) adds every rank's versions side by side."""
    f = m.facts
    v, host, t, nvml = f.get("versions", {}), f.get("host", {}), f.get("torch", {}), f.get("nvml", {})
    out = [HEADER, "", f"- source: {m.source}"]
    if not m.planned:
        out += [
            f"- hetrain version: {_val(v.get('hetrain'))}",
            f"- platform: {_val(host.get('platform'))}; python {_val(host.get('python'))}",
            f"- CPU: {_val(host.get('cpu'))}; {_val(host.get('cpu_count'))} logical cores; "
            f"{_val(host.get('cpu_sockets'))} socket(s); host {_val(host.get('hostname'))}",
            f"- torch: {_val(v.get('torch'))}; built with CUDA: "
            f"{_val(v.get('torch_cuda')) if t.get('built_with_cuda') else 'no'}; "
            f"CUDA usable: {'yes' if t.get('available') else 'no'}" + (f" ({t['error']})" if t.get("error") else ""),
            f"- torch arch list: {' '.join(t.get('arch_list') or []) or 'none'}",
            *_cpu_precision_lines(f.get("cpu_precision")),
            f"- cuDNN: {_val(v.get('cudnn'))}; NCCL: {_val(v.get('nccl'))}",
            f"- NVIDIA driver: {_val(v.get('driver'))} (supports CUDA {_val(v.get('driver_cuda'))}); "
            f"NVML: {_val(v.get('nvml')) if nvml.get('ok') else 'unavailable: ' + _val(nvml.get('error'))}",
        ]
    if rank_versions:
        out += ["", f"Ranks ({len(rank_versions)}):"]
        out += [f"  rank {i}: host {_val(r.get('hostname'))}; torch {_val(r.get('torch'))}; CUDA "
                f"{_val(r.get('torch_cuda'))}; NCCL {_val(r.get('nccl'))}; driver {_val(r.get('driver'))}; "
                f"GPUs {', '.join(r.get('gpus') or []) or 'none'}" for i, r in enumerate(rank_versions)]
    gpus = m.all_gpus
    out += ["", f"GPUs ({len(gpus)}):" if gpus else "GPUs: none (no GPU is present)"]
    from .islands import device_islands

    for d, island in zip(gpus, device_islands(gpus)):
        out += _gpu_lines(d, island)
    rows = matrix(m.devices, m.links)
    if rows:
        out += ["", "Topology (nvidia-smi codes; p2p: ok = copy verified, NO = unavailable, BROKEN = wrong data):"]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        out += [f"  {m.devices[ln.a].label}<->{m.devices[ln.b].label}: ~{_val(ln.estimated_gbs)} GB/s "
                f"estimated ({ln.estimate_basis})"
                + (f"; {ln.measured_gbs} GB/s measured" if ln.measured_gbs else "") for ln in m.links]
    env = m.env
    out += ["", "Environment variables (NCCL_*, CUDA_*, TORCH_NCCL_*, TORCH_DISTRIBUTED_*, "
                "PYTORCH_CUDA_ALLOC_CONF, OMP_NUM_THREADS):"]
    out += [f"  {k}={val}" for k, val in env.items()] or ["  none set"]
    return "\n".join(out) + "\n"


def render_json(m: Machine, rank_versions: tuple[dict, ...] | None = None) -> dict:
    from .islands import device_islands

    out = {"machine": m.facts, "devices": [{**d.to_dict(), "island": island}
                                           for d, island in zip(m.devices, device_islands(m.devices))],
           "topology": [ln.to_dict() for ln in m.links], "env": m.env}
    if rank_versions:
        out["ranks"] = list(rank_versions)
    return out
