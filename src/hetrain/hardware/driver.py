"""The one place hetrain asks the drivers about the machine (torch.cuda and NVML via nvidia-ml-py).

Everything above this module (devices, topology, doctor, env report) works on the plain,
JSON-ready *machine description* returned here, so tests feed it recorded machines
(tests/fixtures/machines/*.json) and `hetrain doctor --machine FILE` checks one recorded elsewhere.

A failing query never raises: it becomes an error string in the description (NVML not loaded,
torch without CUDA, a driver call unsupported on this GPU), which the doctor reports as a skipped
check with the reason. The peer copy-and-verify runs in a child process with a deadline, because
on a broken driver a peer copy can hang instead of returning zeros.

The description (schema 1):
  host      hostname, platform, python, cpu, cpu_count, cpu_sockets
  versions  hetrain, torch, torch_cuda, cudnn, nccl, driver, driver_cuda, nvml
  torch     built_with_cuda, available, device_count, arch_list, error
  nvml      ok, error
  gpus      one dict per GPU: cuda_index (None: torch cannot use it), nvml_index, name, uuid,
            pci_bus_id, memory_bytes, compute_capability [major, minor], power_limit_w,
            pcie_gen, pcie_gen_max, pcie_gen_gpu_max, pcie_width, pcie_width_max,
            nvlink_active, numa_node, utilization_pct, h2d_gbs (with measure)
  pairs     one dict per GPU pair (a < b: positions in gpus): a, b, level (nvidia-smi topo
            code: NV#, PIX, PXB, PHB, NODE, SYS), nvlinks, p2p_reported, p2p_verified,
            p2p_error, measured_gbs
  env       the environment variables that change how NCCL/CUDA/torch behave
  net       network interfaces and InfiniBand/RoCE devices (hardware/netfacts.py), for multi-node
            jobs; None in descriptions recorded before it existed (unknown)
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import UsageError
from .host import cpu_identity
from .netfacts import query_net
from .nvml import bus_id, call, error_text, nvml_part, uuid_text

SCHEMA = 1
ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "NVIDIA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME")
PEER_TIMEOUT_S = 60.0     # the copy-and-verify child's deadline (CUDA start-up on 8 GPUs included)


def relevant_env(environ=None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def _host() -> dict:
    cpu, sockets = platform.processor() or platform.machine(), None
    try:   # Linux: the model name and how many sockets ('physical id's)
        text = Path("/proc/cpuinfo").read_text()
        cpu = cpu_identity()[0]
        ids = {ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("physical id")}
        sockets = len(ids) or None
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "cpu_sockets": sockets}


# -- torch.cuda ------------------------------------------------------------------------------
def torch_part(facts: dict) -> list[dict]:
    import torch

    from ..version import __version__

    v = facts["versions"]
    v.update(hetrain=__version__, torch=torch.__version__, torch_cuda=torch.version.cuda)
    t = facts["torch"] = {"built_with_cuda": torch.version.cuda is not None, "available": False,
                          "device_count": 0, "arch_list": [], "error": None}
    gpus: list[dict] = []
    try:
        t["available"] = bool(torch.cuda.is_available())
        if not t["available"]:
            return gpus
        t["arch_list"] = list(torch.cuda.get_arch_list())
        t["device_count"] = torch.cuda.device_count()
        v["cudnn"] = torch.backends.cudnn.version()
        try:
            v["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:   # torch built without NCCL (e.g. Windows)
            v["nccl"] = None
            t["error"] = f"NCCL: {error_text(e)}"
        for i in range(t["device_count"]):
            p = torch.cuda.get_device_properties(i)
            bus = getattr(p, "pci_bus_id", None)
            gpus.append({
                "cuda_index": i, "nvml_index": None, "name": p.name,
                "uuid": uuid_text(getattr(p, "uuid", None)),
                "pci_bus_id": (bus_id(getattr(p, "pci_domain_id", 0), bus, getattr(p, "pci_device_id", 0))
                               if isinstance(bus, int) else None),
                "memory_bytes": int(p.total_memory), "compute_capability": [p.major, p.minor]})
    except Exception as e:
        t["error"] = error_text(e)
    return gpus


# -- merging and peer access -----------------------------------------------------------------
def _merge(torch_gpus: list[dict], nvml_gpus: list[dict]) -> list[dict]:
    """torch's view (CUDA indices) enriched with NVML's, matched by UUID, else PCI bus id.
    GPUs only NVML sees (hidden by CUDA_VISIBLE_DEVICES, or torch without CUDA) keep
    cuda_index None."""
    merged, used = [], set()
    for t in torch_gpus:
        match = next((n for n in nvml_gpus if id(n) not in used and (
            (t["uuid"] and t["uuid"] == n["uuid"]) or (t["pci_bus_id"] and t["pci_bus_id"] == n["pci_bus_id"]))), None)
        if match is None and len(torch_gpus) == len(nvml_gpus):
            match = nvml_gpus[t["cuda_index"]]     # old torch without uuid/bus id: same order
        if match is not None:
            used.add(id(match))
        merged.append({**(match or {}), **{k: v for k, v in t.items() if v is not None}})
    merged += [{**n, "cuda_index": None} for n in nvml_gpus if id(n) not in used]
    return merged


def _cuda_pairs(facts: dict):
    gpus = facts["gpus"]
    for pair in facts["pairs"]:
        a, b = gpus[pair["a"]].get("cuda_index"), gpus[pair["b"]].get("cuda_index")
        if a is not None and b is not None:
            yield pair, a, b


def _report_peers(facts: dict) -> None:
    """torch.cuda.can_device_access_peer, both ways, for every pair torch can use."""
    import torch

    for pair, a, b in _cuda_pairs(facts):
        try:
            pair["p2p_reported"] = bool(torch.cuda.can_device_access_peer(a, b)
                                        and torch.cuda.can_device_access_peer(b, a))
        except Exception as e:
            pair["p2p_error"] = error_text(e)


def _peer_checks_in_child(facts: dict, measure: bool, timeout_s: float = PEER_TIMEOUT_S) -> None:
    """The copy-and-verify (and measurements) in a child process with a deadline: on a broken
    driver a peer copy can hang instead of returning zeros, and the doctor must still answer."""
    _report_peers(facts)
    try:
        child = _run_child(["--peers-here"] + (["--measure"] if measure else []), None,
                           timeout_s + (60 if measure else 0))
    except subprocess.TimeoutExpired:
        for pair, _a, _b in _cuda_pairs(facts):
            if pair["p2p_reported"]:
                pair["p2p_verified"] = False
                pair["p2p_error"] = f"the peer copy check did not finish in {timeout_s:.0f} s (peer copies hang)"
        return
    except Exception as e:
        for pair, _a, _b in _cuda_pairs(facts):
            pair["p2p_error"] = f"the peer copy check could not run: {e}"
        return
    theirs = {(p["a"], p["b"]): p for p in child.get("pairs", ())}
    for pair in facts["pairs"]:
        other = theirs.get((pair["a"], pair["b"]), {})
        for key in ("p2p_verified", "p2p_error", "measured_gbs"):
            pair[key] = other.get(key, pair[key])
    for mine, other in zip(facts["gpus"], child.get("gpus", ())):
        if other.get("h2d_gbs") is not None and mine.get("uuid") == other.get("uuid"):
            mine["h2d_gbs"] = other["h2d_gbs"]


def _peer_checks(facts: dict, measure: bool) -> None:
    """can_device_access_peer plus a copy-and-verify: some drivers report P2P and copy zeros."""
    import torch

    _report_peers(facts)
    for pair, a, b in _cuda_pairs(facts):
        if pair["p2p_reported"]:
            try:   # a known pattern there and back; a broken peer path returns zeros or fails
                src = torch.arange(1, 1 + (1 << 20), dtype=torch.float32, device=f"cuda:{a}")
                there = src.to(f"cuda:{b}")
                back = there.to(f"cuda:{a}")
                for i in (a, b):
                    torch.cuda.synchronize(i)
                pair["p2p_verified"] = bool(torch.equal(there.cpu(), src.cpu()) and torch.equal(back, src))
            except Exception as e:
                pair["p2p_verified"], pair["p2p_error"] = False, error_text(e)
        if measure:
            pair["measured_gbs"] = _measure(torch, f"cuda:{a}", f"cuda:{b}")
    if measure:
        for g in facts["gpus"]:
            if g.get("cuda_index") is not None:
                g["h2d_gbs"] = _measure(torch, "cpu", f"cuda:{g['cuda_index']}")


def _measure(torch, src: str, dst: str) -> float | None:
    try:
        return _copy_gbs(torch, src, dst)
    except Exception:      # e.g. out of memory on a busy GPU: no figure rather than no report
        return None


def _copy_gbs(torch, src: str, dst: str, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """GB/s of a one-way copy src -> dst (pinned host memory when src is the CPU)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=src)
    if src == "cpu":
        x = x.pin_memory()
    y = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    gpus = {torch.device(d).index for d in (src, dst) if d != "cpu"}

    def sync():   # both ends: a cross-device copy may run on either device's stream
        for i in gpus:
            torch.cuda.synchronize(i)

    y.copy_(x, non_blocking=True)                  # warm-up (peer mapping, allocator)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x, non_blocking=True)
    sync()
    return round(nbytes * repeats / (time.perf_counter() - t0) / 1e9, 2)


def query_machine(*, measure: bool = False, peers_here: bool = False) -> dict:
    """Describe this machine from torch.cuda and NVML. Never raises for a missing driver.
    Peer copies run in a child process with a deadline unless `peers_here`."""
    facts: dict = {"schema": SCHEMA, "source": "live", "host": _host(),
                   "versions": {k: None for k in ("hetrain", "torch", "torch_cuda", "cudnn", "nccl",
                                                  "driver", "driver_cuda", "nvml")},
                   "torch": {}, "nvml": {}, "gpus": [], "pairs": [], "env": relevant_env()}
    torch_gpus = torch_part(facts)
    nvml_gpus, nvml_pairs = nvml_part(facts)
    gpus = facts["gpus"] = _merge(torch_gpus, nvml_gpus) if nvml_gpus else torch_gpus
    if nvml_gpus:          # NVML numbers pairs by its own index; re-key them by position in gpus
        where = {g.get("nvml_index"): i for i, g in enumerate(gpus)}
        pairs = [{**p, "a": min(where[p["a"]], where[p["b"]]), "b": max(where[p["a"]], where[p["b"]])}
                 for p in nvml_pairs]
    else:                  # no NVML: pairs of CUDA devices, link type unknown
        pairs = [{"a": a, "b": b, "nvlinks": None, "level": None}
                 for a in range(len(gpus)) for b in range(a + 1, len(gpus))]
    for p in pairs:
        p.update(p2p_reported=None, p2p_verified=None, p2p_error=None, measured_gbs=None)
    facts["pairs"] = sorted(pairs, key=lambda p: (p["a"], p["b"]))
    if facts["torch"].get("available") and (pairs or measure):
        (_peer_checks if peers_here else _peer_checks_in_child)(facts, measure)
    if facts["nvml"]["ok"]:
        import pynvml

        call(pynvml.nvmlShutdown)
    if not gpus:       # no GPU: the CPU is the device (and what CPU-played GPUs run on)
        facts["cpu_precision"] = _cpu_precision()
    facts["net"] = query_net()
    return facts


def _cpu_precision() -> dict | None:
    """This CPU's native bf16/fp16 and measured slowdowns (hardware/host.py; cached per host)."""
    from .host import host_facts

    try:
        return host_facts().to_dict()
    except Exception as e:   # noqa: BLE001 — a report must not fail on one part
        return {"error": f"{type(e).__name__}: {e}"}


def query_machine_in_subprocess(*, environ: dict | None = None, timeout_s: float = 120.0) -> dict:
    """query_machine in a short-lived child (with `environ`, default this process's), so the
    caller (the launcher) holds no CUDA context on any GPU afterwards. Raises RuntimeError when
    the child fails, subprocess.TimeoutExpired when it hangs."""
    return _run_child([], environ, timeout_s)


def _run_child(args: list[str], environ: dict | None, timeout_s: float) -> dict:
    env = dict(os.environ if environ is None else environ)
    # The child must import this same hetrain, even when it came from a path only sys.path knows.
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-m", "hetrain.hardware.driver", *args], capture_output=True,
                         text=True, timeout=timeout_s, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout)


def load_machine(path: str) -> dict:
    """A recorded description: this module's output, or `hetrain env --json` (its 'machine')."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"machine file {path!r} does not exist",
                         "record one with `hetrain env --json > machine.json`") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read machine file {path!r}: {e}",
                         "give a JSON file written by `hetrain env --json`") from None
    data = data.get("machine", data) if isinstance(data, dict) else data
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or "gpus" not in data:
        raise UsageError(f"{path!r} is not a hetrain machine description (schema {SCHEMA})",
                         "give a JSON file written by `hetrain env --json`")
    data.setdefault("pairs", [])
    data.setdefault("env", {})
    data.setdefault("net", None)          # recorded before the network was: unknown
    data["source"] = f"recorded: {Path(path).name}"
    return data


if __name__ == "__main__":   # the child of query_machine_in_subprocess / _peer_checks_in_child
    flags = sys.argv[1:]
    print(json.dumps(query_machine(measure="--measure" in flags, peers_here="--peers-here" in flags)))
