"""A stand-in for the `pynvml` module (nvidia-ml-py) that answers from a small description, so the
NVML half of hetrain.hardware.driver runs on machines without a GPU driver.

It implements only the calls driver.py makes, with pynvml's names, constants and error type;
an unsupported query raises NVMLError like the real library does on older GPUs.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field


class NVMLError(Exception):
    def __init__(self, value: int, text: str):
        self.value = value
        super().__init__(text)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self):
        super().__init__(9, "Driver Not Loaded")


class NVMLError_NotSupported(NVMLError):
    def __init__(self):
        super().__init__(3, "Not Supported")


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus: str                               # '00000000:01:00.0'
    memory: int
    cc: tuple[int, int]
    power_mw: int | None = 350_000         # None: not supported on this GPU
    pcie: tuple[int, int, int, int, int] = (4, 4, 4, 16, 16)   # gen, gen_max, gpu gen max, width, width max
    nvlinks: list = field(default_factory=list)   # remote bus id per active link, or 'switch'
    util: int = 0


def make(gpus: list[FakeGpu], *, levels: dict | None = None, driver: str = "550.54.15",
         cuda: int = 12040, init_error: Exception | None = None) -> types.ModuleType:
    """A pynvml-like module. `levels[(a, b)]`: NVML topology level between GPU a and b."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVML_NVLINK_MAX_LINKS = 18
    nv.NVML_FEATURE_ENABLED = 1
    nv.NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    nv.NVML_P2P_CAPS_INDEX_NVLINK = 2
    nv.NVML_P2P_STATUS_OK = 0
    nv.calls = []

    def init():
        nv.calls.append("init")
        if init_error is not None:
            raise init_error

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: nv.calls.append("shutdown")
    nv.nvmlSystemGetDriverVersion = lambda: driver
    nv.nvmlSystemGetNVMLVersion = lambda: "12." + driver
    nv.nvmlSystemGetCudaDriverVersion = lambda: cuda
    nv.nvmlDeviceGetCount = lambda: len(gpus)
    nv.nvmlDeviceGetHandleByIndex = lambda i: i

    def power(h):
        if gpus[h].power_mw is None:
            raise NVMLError_NotSupported()
        return gpus[h].power_mw

    def link_state(h, link):
        # GPUs without NVLink answer 'Not Supported' from link 0; others have 12 links here,
        # the first len(nvlinks) of them active.
        if not gpus[h].nvlinks or link >= 12:
            raise NVMLError_NotSupported()
        return 1 if link < len(gpus[h].nvlinks) else 0

    def remote_pci(h, link):
        target = gpus[h].nvlinks[link]
        return types.SimpleNamespace(busId="00000000:00:00.0" if target == "switch" else target)

    def remote_type(h, link):
        return 2 if gpus[h].nvlinks[link] == "switch" else 0

    def p2p(a, b, index):
        switched = any(t == "switch" for t in gpus[a].nvlinks) and any(t == "switch" for t in gpus[b].nvlinks)
        return 0 if switched else 1

    nv.nvmlDeviceGetName = lambda h: gpus[h].name
    nv.nvmlDeviceGetUUID = lambda h: gpus[h].uuid
    nv.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=gpus[h].bus)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=gpus[h].memory)
    nv.nvmlDeviceGetCudaComputeCapability = lambda h: gpus[h].cc
    nv.nvmlDeviceGetEnforcedPowerLimit = power
    nv.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: gpus[h].pcie[0]
    nv.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: gpus[h].pcie[1]
    nv.nvmlDeviceGetGpuMaxPcieLinkGeneration = lambda h: gpus[h].pcie[2]
    nv.nvmlDeviceGetCurrPcieLinkWidth = lambda h: gpus[h].pcie[3]
    nv.nvmlDeviceGetMaxPcieLinkWidth = lambda h: gpus[h].pcie[4]
    nv.nvmlDeviceGetNvLinkState = link_state
    nv.nvmlDeviceGetNvLinkRemotePciInfo = remote_pci
    nv.nvmlDeviceGetNvLinkRemoteDeviceType = remote_type
    nv.nvmlDeviceGetP2PStatus = p2p
    nv.nvmlDeviceGetNumaNodeId = lambda h: 0
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=gpus[h].util)
    nv.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: (levels or {}).get((min(a, b), max(a, b)), 30)
    return nv
