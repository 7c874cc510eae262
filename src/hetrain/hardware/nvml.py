"""NVML's part of the machine description (hardware/driver.py): each GPU's name, UUID, bus id,
memory, power limit, PCIe links and NVLinks, and the topology between every pair. Every call can
fail on some GPU or driver: `call` turns a failure into None, so one missing figure never stops
the description. Also the id spellings NVML and torch.cuda must agree on (UUIDs, PCI bus ids)."""

from __future__ import annotations

LEVELS = {0: "INT", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}   # NVML topology


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def uuid_text(u) -> str | None:
    if u is None:
        return None
    s = str(u).lower()
    return s if s.startswith(("gpu-", "mig-")) else f"gpu-{s}"


def bus_id(domain, bus, device) -> str:
    return f"{int(domain or 0):08x}:{int(bus):02x}:{int(device or 0):02x}.0"


def norm_bus(s: str | None) -> str | None:
    """'00000000:01:00.0' and '0000:01:00.0' compare equal."""
    if not s:
        return None
    dom, rest = s.lower().split(":", 1) if s.count(":") == 2 else ("0", s.lower())
    return f"{int(dom, 16):08x}:{rest}"


def nvml_part(facts: dict) -> tuple[list[dict], list[dict]]:
    """GPU records and pairs from NVML; failures recorded in facts['nvml']."""
    facts["nvml"] = {"ok": False, "error": None}
    try:
        import pynvml as nv
    except ImportError as e:
        facts["nvml"]["error"] = f"nvidia-ml-py is not installed ({e}); pip install nvidia-ml-py"
        return [], []
    try:
        nv.nvmlInit()
    except Exception as e:   # no driver: 'NVML Shared Library Not Found', 'Driver Not Loaded'
        facts["nvml"]["error"] = error_text(e)
        return [], []
    facts["nvml"]["ok"] = True
    v = facts["versions"]
    v["driver"] = call(nv.nvmlSystemGetDriverVersion)
    v["nvml"] = call(nv.nvmlSystemGetNVMLVersion)
    cuda = call(nv.nvmlSystemGetCudaDriverVersion)
    v["driver_cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
    gpus, handles = [], []
    for i in range(call(nv.nvmlDeviceGetCount) or 0):
        h = call(nv.nvmlDeviceGetHandleByIndex, i)
        if h is None:     # e.g. 'GPU is lost' or no permission: drop it and say so
            facts["nvml"]["error"] = f"GPU {i}: no NVML handle (lost, or no permission)"
            continue
        handles.append(h)
        pci = call(nv.nvmlDeviceGetPciInfo, h)
        mem = call(nv.nvmlDeviceGetMemoryInfo, h)
        cc = call(nv.nvmlDeviceGetCudaComputeCapability, h)
        power = call(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        util = call(nv.nvmlDeviceGetUtilizationRates, h)
        gpus.append({
            "nvml_index": i, "name": _str(call(nv.nvmlDeviceGetName, h)),
            "uuid": uuid_text(_str(call(nv.nvmlDeviceGetUUID, h))),
            "pci_bus_id": norm_bus(_str(getattr(pci, "busId", None))),
            "memory_bytes": int(mem.total) if mem is not None else None,
            "compute_capability": list(cc) if cc else None,
            "power_limit_w": power / 1000 if isinstance(power, int) else None,
            "pcie_gen": call(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_gen_max": call(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
            "pcie_gen_gpu_max": call(nv.nvmlDeviceGetGpuMaxPcieLinkGeneration, h),
            "pcie_width": call(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            "pcie_width_max": call(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            "nvlink_active": _active_links(nv, h),
            "numa_node": call(nv.nvmlDeviceGetNumaNodeId, h),
            "utilization_pct": getattr(util, "gpu", None)})
    pairs = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            level = call(nv.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])
            links = _links_between(nv, handles[a], handles[b], gpus[b]["pci_bus_id"])
            pairs.append({"a": gpus[a]["nvml_index"], "b": gpus[b]["nvml_index"], "nvlinks": links,
                          "level": f"NV{links}" if links else LEVELS.get(level)})
    return gpus, pairs


def call(fn, *args):
    """An NVML query that some GPUs or drivers do not support: None instead of an exception."""
    try:
        return fn(*args)
    except Exception:
        return None


def _str(x) -> str | None:
    return x.decode() if isinstance(x, bytes) else x


def _active_links(nv, h) -> int:
    n = 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        state = call(nv.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            break    # no such link (or no NVLink at all)
        n += state == nv.NVML_FEATURE_ENABLED
    return n


def _links_between(nv, ha, hb, bus_b: str | None) -> int:
    """Direct links a->b; through an NVSwitch (HGX boards) every active link of a reaches b."""
    direct = switched = 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        state = call(nv.nvmlDeviceGetNvLinkState, ha, link)
        if state is None:
            break
        if state != nv.NVML_FEATURE_ENABLED:
            continue
        remote = call(nv.nvmlDeviceGetNvLinkRemotePciInfo, ha, link)
        if remote is not None and norm_bus(_str(remote.busId)) == bus_b:
            direct += 1
        elif call(nv.nvmlDeviceGetNvLinkRemoteDeviceType, ha, link) == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH:
            switched += 1
    if direct:
        return direct
    via_switch = call(nv.nvmlDeviceGetP2PStatus, ha, hb, nv.NVML_P2P_CAPS_INDEX_NVLINK)
    return switched if via_switch == nv.NVML_P2P_STATUS_OK else 0
