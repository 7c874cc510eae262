"""Bad island input under the CLI: one line with the fix, exit 2, caught before anything starts
(in this process, the launcher replaced by a guard)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from clirun import hetrain_here, one_line_error
from hetrain import launch
from hetrain.cli import train as train_cli
from hetrain.errors import UsageError
from hetrain.hardware import islands


@pytest.fixture
def script(tmp_path, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("bad input reached the launcher")

    monkeypatch.setattr(train_cli, "run_launch", no_launch)
    monkeypatch.setattr(launch, "run_launch", no_launch)
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('not to be run')\n")
    return str(path)


def test_an_unknown_kind_in_an_island_is_one_line_with_did_you_mean():
    r = hetrain_here("simulate", "--cluster", "nv=2xa100-80g/nvlink; amd=2xmi30x/xgmi; bridge=host:25GbE",
                     "--model", "gpt2-124m")
    one_line_error(r, "unknown GPU 'mi30x'", "did you mean: mi300x")


def test_two_islands_without_a_bridge_is_one_line(script):
    one_line_error(hetrain_here("run", "--emulate", "nv=2xa100-80g; amd=2xmi300x", script),
                   "2 device islands (nv, amd) but no bridge", "bridge=host:25GbE")


def test_an_island_mixing_vendors_is_one_line(script):
    one_line_error(hetrain_here("run", "--emulate", "nv=a100-80g,mi300x; bridge=host", script),
                   "island 'nv' mixes device vendors (nvidia: a100-80g; amd: mi300x)", "own island")
    one_line_error(hetrain_here("simulate", "--cluster", "a100-80g,gaudi2", "--model", "gpt2-124m"),
                   "mixes device vendors", "bridge=host:25GbE")


def test_a_device_type_this_torch_cannot_use_is_one_line_for_a_real_run(script, monkeypatch):
    monkeypatch.setattr(islands, "present_accelerators", lambda root="/": {"hpu": "/dev/accel/accel0 (habanalabs driver)"})
    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    one_line_error(hetrain_here("run", script), "/dev/accel/accel0", "need habana_frameworks.torch",
                   "Intel Gaudi's PyTorch")


def test_the_island_spec_is_accepted_by_simulate_and_named():
    r = hetrain_here("simulate", "--cluster", "nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi; bridge=host:25GbE",
                     "--model", "gpt2-124m")
    assert r.returncode == 0, r.stderr
    assert "islands: nv = a100-80g#0,a100-80g#1 (nccl), amd = mi300x#2,mi300x#3 (rccl); bridge host 25GbE" in r.stdout


@dataclass(frozen=True)
class _Ctx:
    rank: int = 0
    world_size: int = 4
    local_rank: int = 0
    local_world_size: int = 2
    device: str = "cpu"
    restart: int = 0


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, message):
        self.lines.append(message)

    warn_job = info


def _records(rocm_b):
    cuda = {"torch": "2.5.1", "torch_cuda": "12.4", "nccl": "2.21.5", "driver": "550.54", "cudnn": 90100}
    rocm = {"torch": "2.5.1", "torch_cuda": None, "nccl": "2.20.5", "driver": None, "cudnn": None}
    nv = {"vendor": "nvidia", "device_type": "cuda", "backend": "nccl", "island": ""}
    amd = {"vendor": "amd", "device_type": "cuda", "backend": "nccl", "island": ""}
    return [{"versions": cuda, "island": nv, "restart": 0}, {"versions": cuda, "island": nv, "restart": 0},
            {"versions": rocm, "island": amd, "restart": 0}, {"versions": rocm_b, "island": amd, "restart": 0}]


@pytest.mark.parametrize("nccl", ["2.20.5", "2.18.3"])
def test_job_start_finds_islands_and_compares_versions_inside_each(monkeypatch, nccl):
    """join_nodes (Engine.__init__'s step) on a fabricated gather of four real ranks on three
    nodes: an NVIDIA node, and an AMD island over two nodes whose RCCL differs in the second case."""
    from hetrain.runtime.config import Config
    from hetrain.runtime.ranks import nodes as nodes_mod

    rocm_b = {"torch": "2.5.1", "torch_cuda": None, "nccl": nccl, "driver": None, "cudnn": None}
    table = _records(rocm_b)
    job = nodes_mod.JobNodes(names=("dgx", "mi-a", "mi-b"), node_of=(0, 0, 1, 2))
    monkeypatch.setattr(nodes_mod, "gather", lambda **k: (job, table))
    monkeypatch.setattr("hetrain.hardware.node_versions.versions_here", lambda: {})
    log = _Log()
    if nccl == "2.20.5":
        _, _, found, cluster = nodes_mod.join_nodes(_Ctx(), Config(global_batch=8), log)
        assert cluster is None
        assert found.islands.describe() == "islands: nvidia = ranks 0,1 (nccl), amd = ranks 2,3 (rccl); " \
                                           "bridge gloo over host memory"
        assert log.lines[-1] == found.islands.describe()
    else:
        with pytest.raises(UsageError) as e:
            nodes_mod.join_nodes(_Ctx(), Config(global_batch=8), log)
        assert e.value.what.startswith("in device island 'amd' (ranks 2,3): NCCL differs across nodes")
        assert e.value.exit_code == 2


def test_doctor_and_env_show_each_devices_vendor_and_island():
    import json

    spec = "nv=a100-80g; gaudi=gaudi2; bridge=host:25GbE"
    r = hetrain_here("doctor", "--cluster", spec, "--json")
    assert r.returncode == 0, r.stderr
    devices = json.loads(r.stdout)["devices"]
    assert [(d["vendor"], d["island"], d["real_bf16"]) for d in devices] == [("nvidia", "nv", True),
                                                                               ("intel", "gaudi", True)]
    text = hetrain_here("env", "--cluster", "2xa100-80g,cpu").stdout
    assert "vendor: nvidia (torch device type and library: cuda, nccl); island: nvidia" in text
    assert "vendor: cpu (torch device type and library: cpu, gloo); island: cpu" in text
