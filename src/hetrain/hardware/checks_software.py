"""Doctor checks on the software stack: NVML, the torch build, GPU architectures vs the build,
driver/CUDA/NCCL versions (and the same on every rank), CUDA_DEVICE_ORDER.

Each check takes (machine, options) and returns findings; none raises on missing facts.
"""

from __future__ import annotations

import re

from .findings import DoctorOptions, Finding, skipped
from .machine import Machine

PLANNED = "a planned cluster: no driver or torch build to check"
# Driver series with known multi-GPU problems (the issues cited in each line): (prefix, what, fix).
BAD_DRIVERS = (
    ("545.", "P2P copies fail or hang on 545 drivers (pytorch#119638, nccl#1127)",
     "update the NVIDIA driver to 550 or later"),
    ("560.", "multi-GPU hangs reported on 560 drivers, fixed in 570 (dmlc/xgboost#11242)",
     "update the NVIDIA driver to 570 or later"),
)
_ARCH = re.compile(r"^(sm|compute)_(\d+)(\d)([a-z]?)$")


def _ver(s: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", s or "")[:2])


def _cuda_wheel(cuda: str | None) -> str:
    major_minor = "".join(str(x) for x in _ver(cuda)) or "124"
    return f"pip install torch --index-url https://download.pytorch.org/whl/cu{major_minor}"


def check_nvml(m: Machine, o: DoctorOptions) -> list[Finding]:
    if m.planned:
        return [skipped("nvml", PLANNED)]
    nvml, v = m.facts.get("nvml", {}), m.facts.get("versions", {})
    if nvml.get("ok") and nvml.get("error"):
        return [Finding(level="warn", check="nvml", message=f"NVML answers, but {nvml['error']}",
                        why="that GPU is missing from every other check",
                        fix="run `nvidia-smi -q` to see its state; a lost GPU needs a reset or reboot")]
    if nvml.get("ok"):
        return [Finding(level="ok", check="nvml",
                        message=f"NVML {v.get('nvml')} with driver {v.get('driver')}")]
    return [skipped("nvml", f"NVML unavailable ({nvml.get('error') or 'unknown reason'}): power, PCIe, "
                    "NVLink and driver checks are skipped",
                    "on a GPU machine: install or load the NVIDIA driver (`nvidia-smi` must work) "
                    "and `pip install nvidia-ml-py`")]


def check_torch_cuda(m: Machine, o: DoctorOptions) -> list[Finding]:
    if m.planned:
        return [skipped("torch-cuda", PLANNED)]
    t, v = m.facts.get("torch", {}), m.facts.get("versions", {})
    seen_by_nvml = [g for g in m.facts.get("gpus", ()) if g.get("nvml_index") is not None]
    torch_v = v.get("torch") or "?"
    if not t.get("built_with_cuda"):
        if seen_by_nvml:
            return [Finding(level="error", check="torch-cuda",
                            message=f"torch {torch_v} is built without CUDA, but the driver sees "
                                    f"{len(seen_by_nvml)} GPU(s)",
                            why="every process would train on the CPU; the GPUs stay idle",
                            fix=f"install a CUDA build of torch for driver CUDA {v.get('driver_cuda')}, "
                                f"e.g. {_cuda_wheel(v.get('driver_cuda'))}")]
        return [Finding(level="warn", check="torch-cuda",
                        message=f"torch {torch_v} is built without CUDA, and no NVIDIA driver answers "
                                "(no GPU is present)",
                        why="hetrain can only run CPU processes here: one process, or a cluster spec's "
                            "devices, each a CPU process at its card's speed and memory",
                        fix="to train on GPUs use a machine with NVIDIA GPUs and a CUDA build of torch; "
                            "here, try `hetrain demo`, or see `hetrain run --help` to run a script on a cluster "
                            "spec such as a100-80g,rtx3090")]
    if not t.get("available"):
        why = t.get("error") or "torch.cuda.is_available() is False"
        torch_cuda, drv_cuda = _ver(v.get("torch_cuda")), _ver(v.get("driver_cuda"))
        if torch_cuda and drv_cuda and drv_cuda[0] < torch_cuda[0]:
            return [Finding(level="error", check="torch-cuda",
                            message=f"the driver supports CUDA {v.get('driver_cuda')}, older than torch's "
                                    f"CUDA {v.get('torch_cuda')}",
                            why="torch cannot start CUDA with a driver older than its CUDA major version",
                            fix=f"update the NVIDIA driver, or install torch for CUDA {v.get('driver_cuda')}: "
                                f"{_cuda_wheel(v.get('driver_cuda'))}")]
        level = "error" if seen_by_nvml else "warn"
        return [Finding(level=level, check="torch-cuda",
                        message=f"torch {torch_v} has CUDA {v.get('torch_cuda')} but cannot use a GPU ({why})",
                        why="every process would train on the CPU",
                        fix="check `nvidia-smi` and CUDA_VISIBLE_DEVICES (empty or wrong ids hide every GPU)")]
    return [Finding(level="ok", check="torch-cuda",
                    message=f"torch {torch_v} with CUDA {v.get('torch_cuda')}: {t.get('device_count')} GPU(s) visible")]


def arch_support(cc: tuple[int, int], arch_list) -> str | None:
    """'sass' (a binary runs: same major, equal or lower minor), 'ptx' (JIT from PTX) or None."""
    parsed = [m for m in (_ARCH.match(a) for a in arch_list) if m]
    for m in parsed:
        major, minor, suffix = int(m[2]), int(m[3]), m[4]
        if m[1] == "sm" and major == cc[0] and (minor == cc[1] or (minor < cc[1] and not suffix)):
            return "sass"
    if any(m[1] == "compute" and (int(m[2]), int(m[3])) <= cc for m in parsed):
        return "ptx"
    return None


def check_arch(m: Machine, o: DoctorOptions) -> list[Finding]:
    arch_list = m.facts.get("torch", {}).get("arch_list") or []
    gpus = [d for d in m.gpus if d.compute_capability]
    if m.planned or not arch_list or not gpus:
        return [skipped("arch", PLANNED if m.planned else "no GPU usable by torch: nothing to compare "
                        "with torch.cuda.get_arch_list()")]
    out = []
    for d in gpus:
        sm = "sm_{}{}".format(*d.compute_capability)
        how = arch_support(d.compute_capability, arch_list)
        if how is None:
            newer = d.compute_capability >= (12, 0)
            out.append(Finding(
                level="error", check="arch",
                message=f"{d.label} {d.name} is {sm}, not in this torch build ({' '.join(arch_list)})",
                why="CUDA kernels fail with 'no kernel image is available for execution on the device'",
                fix=("install a torch build for CUDA 12.8 or later, which includes sm_120: "
                     "pip install torch --index-url https://download.pytorch.org/whl/cu128") if newer
                else f"install a torch build whose arch list includes {sm} (see pytorch.org 'Get started')"))
        elif how == "ptx":
            out.append(Finding(
                level="warn", check="arch",
                message=f"{d.label} {d.name} ({sm}) runs from PTX compiled at start-up, not a prebuilt binary",
                why="the first start compiles kernels for minutes and may run slower",
                fix=f"install a torch build whose arch list includes {sm}"))
    return out or [Finding(level="ok", check="arch",
                           message="every GPU's architecture is in the torch build (" + " ".join(arch_list) + ")")]


def check_versions(m: Machine, o: DoctorOptions) -> list[Finding]:
    if m.planned:
        return [skipped("versions", PLANNED)]
    v = m.facts.get("versions", {})
    found = (f"torch {v.get('torch')}, CUDA {v.get('torch_cuda') or 'none'}, NCCL {v.get('nccl') or 'none'}, "
             f"driver {v.get('driver') or 'unknown'} (supports CUDA {v.get('driver_cuda') or '?'})")
    out = []
    for prefix, what, fix in BAD_DRIVERS:
        if (v.get("driver") or "").startswith(prefix):
            out.append(Finding(level="warn", check="versions", message=f"driver {v['driver']}: {what}",
                               why="collectives can hang or peer copies return wrong data", fix=fix))
    torch_cuda, drv_cuda = _ver(v.get("torch_cuda")), _ver(v.get("driver_cuda"))
    if torch_cuda and drv_cuda and drv_cuda[0] == torch_cuda[0] and drv_cuda < torch_cuda:
        out.append(Finding(level="warn", check="versions",
                           message=f"driver CUDA {v['driver_cuda']} is older than torch's CUDA {v['torch_cuda']}",
                           why="CUDA minor-version compatibility runs it, but PTX JIT and some features fail",
                           fix="update the NVIDIA driver to one for CUDA " + v["torch_cuda"]))
    return out or [Finding(level="ok", check="versions", message=found)]


RANK_FIELDS = (("nccl", "error"), ("torch", "error"), ("torch_cuda", "error"), ("driver", "warn"))


def check_rank_versions(m: Machine, o: DoctorOptions) -> list[Finding]:
    if m.planned:
        return [skipped("rank-versions", PLANNED)]
    if o.rank_versions is None:
        return [skipped("rank-versions", "not under torchrun: nothing to compare across ranks",
                        "to compare every rank and node: torchrun --nproc-per-node=N [--nnodes ...] -m hetrain doctor")]
    out = []
    for key, level in RANK_FIELDS:
        values = [r.get(key) for r in o.rank_versions]
        if len(set(values)) > 1:
            side = ", ".join(f"rank {i} {val} ({r.get('hostname')})" for i, (val, r) in
                             enumerate(zip(values, o.rank_versions)))
            out.append(Finding(level=level, check="rank-versions", message=f"{key} differs across ranks: {side}",
                               why="NCCL cannot connect ranks with different versions (nccl#1267); "
                                   "mixed torch builds compute differently",
                               fix=f"install the same torch (and so NCCL) and driver on every node; "
                                   f"rank 0 has {key} {values[0]}"))
    return out or [Finding(level="ok", check="rank-versions",
                           message=f"{len(o.rank_versions)} ranks agree on torch, CUDA, NCCL and driver")]


def check_device_order(m: Machine, o: DoctorOptions) -> list[Finding]:
    gpus = [d for d in m.gpus if d.kind == "cuda"]
    if m.planned or len(gpus) < 2:
        return [skipped("device-order", PLANNED if m.planned else "fewer than 2 GPUs: no order to get wrong")]
    order = m.env.get("CUDA_DEVICE_ORDER")
    if order == "PCI_BUS_ID":
        return [Finding(level="ok", check="device-order",
                        message="CUDA_DEVICE_ORDER=PCI_BUS_ID: cuda:N is nvidia-smi's GPU N")]
    moved = [f"{d.label} is nvidia-smi GPU {d.nvml_index}" for d in gpus
             if d.nvml_index is not None and d.nvml_index != d.index]
    mixed = len({d.name for d in gpus}) > 1
    if not (moved or mixed):
        return [Finding(level="ok", check="device-order",
                        message=f"CUDA_DEVICE_ORDER={order or 'unset'}; identical GPUs, indices match nvidia-smi",
                        env=(("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),))]
    return [Finding(
        level="warn", check="device-order",
        message=(f"CUDA_DEVICE_ORDER={order or 'unset (FASTEST_FIRST)'}: "
                 + ("; ".join(moved) if moved else "CUDA numbers mixed GPUs fastest first, not as nvidia-smi does")),
        why="settings by GPU index (CUDA_VISIBLE_DEVICES, power limits, logs) hit a different card than meant",
        fix="export CUDA_DEVICE_ORDER=PCI_BUS_ID before starting Python (hetrain run sets it); identify GPUs by UUID",
        env=(("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),))]


CHECKS = (check_nvml, check_torch_cuda, check_arch, check_versions, check_rank_versions, check_device_order)
