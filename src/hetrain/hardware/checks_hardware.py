"""Doctor checks on the GPUs and how they are wired: which GPUs, catalog, precision, mixed card
classes, peer-to-peer, links, PCIe lanes, memory spread, power headroom.

Each check takes (machine, options) and returns findings; none raises on missing facts.
"""

from __future__ import annotations

import math

from .findings import PSU_HEADROOM, DoctorOptions, Finding, skipped
from .machine import Machine
from .units import format_bytes

NO_GPU = "no GPU is present"
P2P_FIX = ("set NCCL_P2P_DISABLE=1 the same way on every rank before init_process_group "
           "(`hetrain run` sets it; set NCCL_P2P_DISABLE=0 yourself to opt out)")


def _names(devices) -> str:
    return ", ".join(f"{d.label} {d.name}" for d in devices)


def check_gpus(m: Machine, o: DoctorOptions) -> list[Finding]:
    gpus, hidden = m.gpus, [d for d in m.all_gpus if not d.visible]
    if not m.all_gpus:
        return [Finding(level="warn", check="gpus", message=f"{NO_GPU}: only the CPU ({m.devices[0].name})",
                        why="training runs on the CPU; hetrain can still run a mixed cluster of catalog GPUs "
                            "on it, each device a CPU process at its card's speed and memory",
                        fix="`hetrain demo`; `hetrain run --help` shows how to run your script on a cluster spec "
                            "such as a100-80g,rtx3090")]
    out = [Finding(level="ok", check="gpus", message=f"{len(gpus)} GPU(s): {_names(gpus)}")] if gpus else []
    if hidden and not m.facts.get("torch", {}).get("available"):
        out.append(Finding(level="warn", check="gpus",
                           message=f"{len(hidden)} GPU(s) the driver sees, but torch cannot use CUDA: {_names(hidden)}",
                           why="the job would run on the CPU", fix="see the torch-cuda finding"))
    elif hidden:
        cvd = m.env.get("CUDA_VISIBLE_DEVICES")
        out.append(Finding(
            level="warn", check="gpus",
            message=f"{len(hidden)} GPU(s) the driver sees are not usable by torch: {_names(hidden)}"
                    + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""),
            why="the job will not use them",
            fix="unset CUDA_VISIBLE_DEVICES or list their UUIDs in it, if you meant to use them"))
    unknown = [d for d in m.all_gpus if not d.in_catalog]
    for d in unknown:
        out.append(Finding(level="warn", check="catalog", message=d.notes[0],
                           why="no datasheet speed, bandwidth or TDP for it: estimates fall back to the driver's facts",
                           fix="nothing to do to train; to add it, open an issue with `hetrain env` output"))
    return out


def _cpu_precision_finding(recorded: dict | None) -> Finding:
    """No GPU: what this CPU does with bf16/fp16 (hardware/host.py), and what that means for devices
    computing on it."""
    from .host import HostFacts

    try:
        host = HostFacts.from_dict(recorded) if recorded else None
    except (ValueError, TypeError, KeyError):
        host = None
    if host is None:
        why = recorded.get("error", "not recorded") if isinstance(recorded, dict) else "not recorded"
        return skipped("precision", f"{NO_GPU}; this CPU's bf16/fp16 speed is unknown ({why})",
                       fix="run `hetrain doctor` on the machine itself to measure it")
    slow = [p for p in ("bf16", "fp16") if not host.keeps_speed(p)]
    return Finding(level="ok", check="precision",
                   message=f"{NO_GPU}: the CPU computes; {host.describe()}",
                   why=host.precision_meaning(),
                   fix="" if not slow else "nothing to do: keep precision='auto' for a cluster spec's "
                                           "devices (precision='fp32' on the CPU itself)")


def check_precision(m: Machine, o: DoctorOptions) -> list[Finding]:
    # non-NVIDIA devices have no compute capability: their catalog entry says bf16 (real_bf16)
    gpus = [d for d in m.gpus if d.compute_capability or d.real_bf16 is not None]
    if not gpus:
        return [_cpu_precision_finding(m.facts.get("cpu_precision"))]
    lacking = [d for d in gpus if not d.real_bf16]
    cc = lambda d: "cc {}.{}".format(*d.compute_capability) if d.compute_capability else d.vendor   # noqa: E731
    if o.precision == "bf16" and lacking:
        return [Finding(level="error", check="precision",
                        message=f"bf16 asked for, but {', '.join(f'{d.label} {d.name} ({cc(d)})' for d in lacking)} "
                                "has no bf16 in hardware",
                        why="torch.cuda.is_bf16_supported() says True there because it counts bf16 done in "
                            "software, which is many times slower (and cuDNN has no bf16 convolutions below cc 8.0)",
                        fix="use precision fp16 (one job-wide GradScaler) or fp32")]
    if o.precision != "auto":
        return [Finding(level="ok", check="precision", message=f"the job uses {o.precision}: every GPU supports it")]
    if not lacking:
        return [Finding(level="ok", check="precision",
                        message=f"all {len(gpus)} GPU(s) have bf16 in hardware (cc >= 8.0): use bf16")]
    if len(lacking) == len(gpus):
        return [Finding(level="ok", check="precision",
                        message="no GPU has bf16 in hardware (all cc < 8.0): use fp16 with a GradScaler",
                        fix="precision='fp16' (bf16 would be done in software, slowly)")]
    return [Finding(level="warn", check="precision",
                    message=f"no bf16 in hardware on {', '.join(f'{d.label} {d.name} ({cc(d)})' for d in lacking)}, "
                            f"while the others have it: the job must use fp16",
                    why="every rank must use the same gradient dtype, and bf16 on cc < 8.0 is done in "
                        "software (torch.cuda.is_bf16_supported() still says True)",
                    fix="train with precision='fp16' (one job-wide GradScaler), or leave the older cards out for bf16")]


def check_mixed_class(m: Machine, o: DoctorOptions) -> list[Finding]:
    gpus = [d for d in m.gpus if d.datacenter is not None]
    if len(m.gpus) < 2:
        return [skipped("mixed-class", "fewer than 2 GPUs")]
    dc = [d for d in gpus if d.datacenter]
    consumer = [d for d in gpus if not d.datacenter]
    ccs = sorted({d.compute_capability for d in m.gpus if d.compute_capability})
    gens = f"; {len(ccs)} generations (cc {', '.join('%d.%d' % c for c in ccs)})" if len(ccs) > 1 else ""
    if dc and consumer:
        return [Finding(level="warn", check="mixed-class",
                        message=f"mixes datacenter ({', '.join(sorted({d.name for d in dc}))}) and consumer/"
                                f"workstation ({', '.join(sorted({d.name for d in consumer}))}) cards{gens}",
                        why="consumer cards differ in peer-to-peer support, ECC, clocks under sustained load "
                            "and cooling; plain DDP runs every card at the slowest one's pace",
                        fix="hetrain splits the batch by measured speed; follow the p2p, power and memory findings")]
    return [Finding(level="ok", check="mixed-class",
                    message=("all datacenter cards" if dc else "all consumer/workstation cards" if consumer
                             else "card classes unknown (not in catalog)") + gens)]


def check_p2p(m: Machine, o: DoctorOptions) -> list[Finding]:
    if len(m.gpus) < 2:
        return [skipped("p2p", "fewer than 2 GPUs: no peer traffic")]
    checked = [ln for ln in m.links if ln.p2p_reported is not None]
    if m.planned or not checked:
        return [skipped("p2p", "peer access not checked: " + ("a planned cluster" if m.planned
                        else "torch cannot use CUDA here"))]
    dev = m.devices
    pair = lambda ln: f"{dev[ln.a].label}<->{dev[ln.b].label} ({ln.code or '?'})"   # noqa: E731
    user = m.env.get("NCCL_P2P_DISABLE")
    kept = f" (you set NCCL_P2P_DISABLE={user}: kept)" if user is not None else ""
    broken = [ln for ln in checked if ln.p2p_broken]
    if broken:
        return [Finding(level="error", check="p2p",
                        message=f"peer access is reported but a copied tensor arrived wrong between "
                                f"{', '.join(pair(ln) for ln in broken)}{kept}",
                        why="NCCL would use the broken path: all-reduce hangs or silently corrupts gradients "
                            "(RTX 40xx drivers returned zeros, nccl-tests#117)",
                        fix=P2P_FIX + "; update the driver", env=(("NCCL_P2P_DISABLE", "1"),))]
    without = [ln for ln in checked if not ln.p2p_reported]
    if not without:
        return [Finding(level="ok", check="p2p",
                        message=f"peer-to-peer verified with a copy between all {len(checked)} GPU pair(s)")]
    consumer = any(dev[i].datacenter is False for ln in without for i in (ln.a, ln.b))
    if consumer and len(without) == len(checked):
        return [Finding(level="warn", check="p2p",
                        message=f"no peer-to-peer, with consumer cards: {', '.join(pair(ln) for ln in without)}{kept}",
                        why="NCCL has hung or timed out on RTX 40xx machines where P2P is off "
                            "(accelerate#2195); disabling it costs nothing here since it is unavailable",
                        fix=P2P_FIX, env=(("NCCL_P2P_DISABLE", "1"),))]
    return [Finding(level="warn", check="p2p",
                    message=f"no peer-to-peer between {', '.join(pair(ln) for ln in without)}",
                    why="NCCL stages their traffic through host memory, so gradient sync between them is slower",
                    fix="nothing to set; for faster sync put these GPUs under one PCIe switch or CPU socket, "
                        "or bridge them")]


def check_topology(m: Machine, o: DoctorOptions) -> list[Finding]:
    # Wiring checks look at every GPU in the box, usable by this torch or not.
    known = [ln for ln in m.links if ln.code]
    if len(m.all_gpus) < 2 or not known:
        return [skipped("topology", "fewer than 2 GPUs" if len(m.all_gpus) < 2 else
                        "link types unknown (NVML unavailable or a planned cluster)")]
    dev, out = m.devices, []
    cross = [ln for ln in known if ln.kind == "cross-socket"]
    if cross:
        out.append(Finding(
            level="warn", check="topology",
            message="GPUs on different CPU sockets: " + ", ".join(
                f"{dev[ln.a].label}<->{dev[ln.b].label} (SYS, ~{ln.estimated_gbs or '?'} GB/s peak)" for ln in cross),
            why="their gradient all-reduce crosses the CPU interconnect, usually the slowest link in the box",
            fix="prefer GPUs on one socket for one job; run each rank on its GPU's NUMA node "
                "(numactl --cpunodebind=N --membind=N)"))
    slow = [ln for ln in known if ln.measured_gbs and ln.estimated_gbs and ln.measured_gbs < 0.5 * ln.estimated_gbs]
    for ln in slow:
        out.append(Finding(level="warn", check="topology",
                           message=f"{dev[ln.a].label}<->{dev[ln.b].label}: measured {ln.measured_gbs} GB/s, "
                                   f"under half the {ln.estimated_gbs} GB/s estimate ({ln.estimate_basis})",
                           why="gradient sync between them will be slower than planned",
                           fix="check the pcie-link finding, the slot wiring and BIOS PCIe settings"))
    kinds = sorted({ln.code if ln.kind != "nvlink" else f"NV{ln.nvlinks}" for ln in known})
    best = max((ln.estimated_gbs or 0) for ln in known)
    worst = min((ln.estimated_gbs or 0) for ln in known)
    span = f"{best:g}" if best == worst else f"{worst:g}-{best:g}"
    return out or [Finding(level="ok", check="topology",
                           message=f"{len(known)} GPU pair(s) linked by {', '.join(kinds)}; "
                                   f"~{span} GB/s peak per direction")]


def check_pcie(m: Machine, o: DoctorOptions) -> list[Finding]:
    gpus = [d for d in m.all_gpus if d.pcie_width_max]
    if not gpus:
        return [skipped("pcie-link", "PCIe link facts unavailable (NVML unavailable, no GPU, or a planned cluster)")]
    out = []
    for d in gpus:
        if d.pcie_width and d.pcie_width < d.pcie_width_max:
            out.append(Finding(level="warn", check="pcie-link",
                               message=f"{d.label} {d.name} runs PCIe x{d.pcie_width} of x{d.pcie_width_max}",
                               why=f"host copies and gradient sync without P2P get {d.pcie_width}/{d.pcie_width_max} "
                                   "of the bandwidth",
                               fix="move the card to a slot wired x16 (boards often split lanes between slots; "
                                   "check risers and the board manual)"))
        if d.pcie_gen_max and d.pcie_gen_gpu_max and d.pcie_gen_max < d.pcie_gen_gpu_max:
            out.append(Finding(level="warn", check="pcie-link",
                               message=f"{d.label} {d.name} is a PCIe gen{d.pcie_gen_gpu_max} card limited to "
                                       f"gen{d.pcie_gen_max} by its slot",
                               why="each generation down halves the link's bandwidth",
                               fix=f"use a gen{d.pcie_gen_gpu_max} slot, or check the BIOS PCIe speed setting"))
        elif d.pcie_gen and d.pcie_gen_max and d.pcie_gen < d.pcie_gen_max and (d.utilization_pct or 0) > 0:
            out.append(Finding(level="warn", check="pcie-link",
                               message=f"{d.label} {d.name} runs PCIe gen{d.pcie_gen} of gen{d.pcie_gen_max} "
                                       "while busy",
                               why="an idle GPU lowers its link speed to save power, a busy one should not",
                               fix="check the BIOS PCIe speed setting, risers and the slot"))
    idle = [d for d in gpus if d.pcie_gen and d.pcie_gen_max and d.pcie_gen < d.pcie_gen_max and not d.utilization_pct]
    note = f" ({len(idle)} idle GPU(s) at a lower generation now: normal power saving)" if idle else ""
    return out or [Finding(level="ok", check="pcie-link",
                           message=f"every GPU's PCIe link runs at its full width and generation{note}")]


def check_memory(m: Machine, o: DoctorOptions) -> list[Finding]:
    gpus = [d for d in m.gpus if d.memory_bytes]
    if len(gpus) < 2:
        return [skipped("memory", "fewer than 2 GPUs: no spread")]
    small, big = min(gpus, key=lambda d: d.memory_bytes), max(gpus, key=lambda d: d.memory_bytes)
    if small.memory_bytes == big.memory_bytes:
        return [Finding(level="ok", check="memory", message=f"every GPU has {format_bytes(big.memory_bytes)}")]
    spread = f"from {format_bytes(small.memory_bytes)} ({small.label} {small.name}) to " \
             f"{format_bytes(big.memory_bytes)} ({big.label} {big.name})"
    if small.memory_bytes >= 0.75 * big.memory_bytes:
        return [Finding(level="ok", check="memory", message=f"memory {spread}")]
    return [Finding(level="warn", check="memory", message=f"memory ranges {spread}",
                    why=f"plain DDP gives every GPU the same batch, so the {format_bytes(small.memory_bytes)} card "
                        f"caps all of them ({small.memory_bytes / big.memory_bytes:.0%} of the largest is used)",
                    fix="nothing with hetrain (it sizes micro-batches per device); elsewhere, size the per-GPU batch "
                        f"for {format_bytes(small.memory_bytes)} and accumulate gradients")]


def check_power(m: Machine, o: DoctorOptions) -> list[Finding]:
    gpus = m.all_gpus
    if not gpus:
        return [skipped("power", f"{NO_GPU}: no GPU power to budget")]
    limits, guessed = [], []
    for d in gpus:
        w = d.power_limit_w or (d.spec.tdp_w if d.spec else None)
        if w is None:
            return [skipped("power", f"power limit of {d.label} {d.name} unknown (NVML unavailable, not in catalog)")]
        if not d.power_limit_w or d.kind == "planned":
            guessed.append(d.label)
        limits.append((d, w))
    total = sum(w for _, w in limits)
    basis = (" (catalog TDPs)" if len(guessed) == len(limits) else
             " (catalog TDP for " + ", ".join(guessed) + ")" if guessed else " (driver power limits)")
    if o.psu_watts is None:
        return [skipped("power", f"GPU power limits total {total:.0f} W{basis}; PSU not checked",
                        f"give --psu-watts W to check it; the seed's rule is >= {total * (1 + PSU_HEADROOM):.0f} W "
                        f"for these GPUs ({PSU_HEADROOM:.0%} headroom)")]
    need = total * (1 + PSU_HEADROOM)
    headroom = o.psu_watts / total - 1
    per_gpu = ", ".join(f"sudo nvidia-smi -i {d.nvml_index if d.nvml_index is not None else d.index} -pl "
                        f"{math.floor(w * o.psu_watts / need)}" for d, w in limits)
    fix = f"use a PSU of at least {math.ceil(need)} W, or lower the GPU power limits: {per_gpu}"
    why = ("the CPU, drives and fans draw on top of the GPUs, and GPUs spike above their limits for "
           "milliseconds: an undersized PSU shuts the machine down mid-run")
    if o.psu_watts < total:
        return [Finding(level="error", check="power",
                        message=f"the GPUs alone may draw {total:.0f} W{basis}, more than the {o.psu_watts:.0f} W PSU",
                        why=why, fix=fix)]
    if o.psu_watts < need:
        return [Finding(level="warn", check="power",
                        message=f"{total:.0f} W of GPU power{basis} leaves {headroom:.0%} headroom on a "
                                f"{o.psu_watts:.0f} W PSU (want {PSU_HEADROOM:.0%})", why=why, fix=fix)]
    return [Finding(level="ok", check="power",
                    message=f"{total:.0f} W of GPU power{basis} on a {o.psu_watts:.0f} W PSU: {headroom:.0%} headroom")]


CHECKS = (check_gpus, check_precision, check_mixed_class, check_p2p, check_topology, check_pcie,
          check_memory, check_power)
