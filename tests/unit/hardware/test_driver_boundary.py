"""The driver boundary: NVML answers (from a stand-in pynvml) become a machine description;
a missing or failing NVML is recorded with its reason and reported as a skipped check."""

import json
import sys

import pytest

import fake_nvml
from fake_nvml import FakeGpu
from hetrain.errors import UsageError
from hetrain.hardware import doctor, driver, machine, nvml

A100 = dict(name="NVIDIA A100 80GB PCIe", uuid="GPU-aaaa", bus="00000000:41:00.0", memory=85097971712, cc=(8, 0),
            power_mw=300_000)
RTX3090 = dict(name="NVIDIA GeForce RTX 3090", uuid="GPU-bbbb", bus="00000000:01:00.0", memory=25438715904,
               cc=(8, 6), power_mw=350_000, pcie=(1, 4, 4, 8, 16))


def use(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)


def check(findings, name):
    (f,) = [f for f in findings if f.check == name]
    return f


def test_nvml_driver_not_loaded_is_a_skipped_check_with_the_reason(monkeypatch):
    use(monkeypatch, fake_nvml.make([], init_error=fake_nvml.NVMLError_DriverNotLoaded()))
    facts = driver.query_machine()
    assert facts["nvml"] == {"ok": False, "error": "NVMLError_DriverNotLoaded: Driver Not Loaded"}
    findings = doctor.run_checks(machine.from_facts(facts))
    nvml = check(findings, "nvml")
    assert nvml.level == "skipped" and "Driver Not Loaded" in nvml.message and nvml.fix
    assert check(findings, "power").level == "skipped"


def test_nvml_library_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)        # import pynvml -> ImportError
    facts = driver.query_machine()
    assert not facts["nvml"]["ok"] and "nvidia-ml-py is not installed" in facts["nvml"]["error"]
    assert check(doctor.run_checks(machine.from_facts(facts)), "nvml").level == "skipped"


def test_nvml_gpus_recorded_and_torch_without_cuda_is_an_error(monkeypatch):
    nv = fake_nvml.make([FakeGpu(**RTX3090), FakeGpu(**A100)], levels={(0, 1): 30}, driver="535.154.05", cuda=12020)
    use(monkeypatch, nv)
    facts = driver.query_machine()
    assert nv.calls == ["init", "shutdown"]
    assert facts["versions"]["driver"] == "535.154.05" and facts["versions"]["driver_cuda"] == "12.2"
    g0, g1 = facts["gpus"]
    assert (g0["name"], g0["uuid"], g0["pci_bus_id"]) == ("NVIDIA GeForce RTX 3090", "gpu-bbbb", "00000000:01:00.0")
    assert g0["cuda_index"] is None                          # this torch has no CUDA
    assert (g0["power_limit_w"], g0["pcie_gen"], g0["pcie_width"], g0["pcie_width_max"]) == (350.0, 1, 8, 16)
    assert g1["compute_capability"] == [8, 0] and g1["nvlink_active"] == 0
    assert facts["pairs"] == [{"a": 0, "b": 1, "nvlinks": 0, "level": "PHB", "p2p_reported": None,
                               "p2p_verified": None, "p2p_error": None, "measured_gbs": None}]
    json.dumps(facts)                                        # JSON-ready, as recorded machines are
    findings = doctor.run_checks(machine.from_facts(facts))
    assert check(findings, "torch-cuda").level == "error"
    assert check(findings, "nvml").level == "ok"
    assert check(findings, "topology").message.startswith("1 GPU pair(s) linked by PHB")


def test_nvswitch_links_count_for_every_pair(monkeypatch):
    gpus = [FakeGpu(name="NVIDIA A100-SXM4-80GB", uuid=f"GPU-{i}", bus=f"00000000:0{i}:00.0", memory=85198045184,
                    cc=(8, 0), power_mw=400_000, nvlinks=["switch"] * 12) for i in range(4)]
    use(monkeypatch, fake_nvml.make(gpus))
    facts = driver.query_machine()
    assert [p["level"] for p in facts["pairs"]] == ["NV12"] * 6
    assert {g["nvlink_active"] for g in facts["gpus"]} == {12}


def test_a_direct_nvlink_bridge(monkeypatch):
    a = FakeGpu(**{**RTX3090, "bus": "00000000:01:00.0", "uuid": "GPU-1", "nvlinks": ["00000000:02:00.0"] * 4})
    b = FakeGpu(**{**RTX3090, "bus": "00000000:02:00.0", "uuid": "GPU-2", "nvlinks": ["00000000:01:00.0"] * 4})
    use(monkeypatch, fake_nvml.make([a, b]))
    m = machine.from_facts(driver.query_machine())
    (link,) = m.links
    assert (link.code, link.kind, link.nvlinks) == ("NV4", "nvlink", 4)
    assert link.estimated_gbs == 56.2                        # 4 x 14.06 GB/s: the 3090's 112.5 GB/s both ways


def test_unsupported_queries_become_unknowns_not_crashes(monkeypatch):
    use(monkeypatch, fake_nvml.make([FakeGpu(**{**A100, "power_mw": None})]))
    facts = driver.query_machine()
    assert facts["gpus"][0]["power_limit_w"] is None
    power = check(doctor.run_checks(machine.from_facts(facts)), "power")
    assert "300 W" in power.message and "catalog TDP" in power.message    # falls back to the datasheet


def test_merge_matches_torch_and_nvml_by_uuid_and_keeps_hidden_gpus():
    torch_gpus = [{"cuda_index": 0, "nvml_index": None, "name": "NVIDIA A100 80GB PCIe", "uuid": "gpu-aaaa",
                   "pci_bus_id": None, "memory_bytes": 1, "compute_capability": [8, 0]}]
    nvml_gpus = [{"nvml_index": 0, "name": "NVIDIA GeForce RTX 3090", "uuid": "gpu-bbbb", "pci_bus_id": "x"},
                 {"nvml_index": 1, "name": "NVIDIA A100 80GB PCIe", "uuid": "gpu-aaaa", "pci_bus_id": "y",
                  "power_limit_w": 300.0}]
    merged = driver._merge(torch_gpus, nvml_gpus)
    assert [(g["cuda_index"], g["nvml_index"], g["name"]) for g in merged] == [
        (0, 1, "NVIDIA A100 80GB PCIe"), (None, 0, "NVIDIA GeForce RTX 3090")]
    assert merged[0]["power_limit_w"] == 300.0 and merged[0]["memory_bytes"] == 1   # torch's facts win


def test_bus_ids_and_uuids_normalise():
    assert nvml.norm_bus("0000:01:00.0") == nvml.norm_bus("00000000:01:00.0") == "00000000:01:00.0"
    assert nvml.uuid_text("5A2D-11") == "gpu-5a2d-11" and nvml.uuid_text("GPU-5a2d") == "gpu-5a2d"


def test_relevant_env_keeps_only_what_changes_nccl_cuda_torch():
    env = {"NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "0,1", "TORCH_NCCL_BLOCKING_WAIT": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "4",
           "HOME": "/root", "AWS_SECRET_ACCESS_KEY": "x", "PATH": "/bin"}
    assert set(driver.relevant_env(env)) == {"NCCL_P2P_DISABLE", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_BLOCKING_WAIT",
                                             "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS"}


def test_load_machine_accepts_env_json_and_rejects_bad_files(tmp_path):
    facts = {"schema": 1, "gpus": [], "host": {}, "versions": {}, "torch": {}, "nvml": {"ok": False}}
    (tmp_path / "env.json").write_text(json.dumps({"machine": facts, "devices": []}))
    assert driver.load_machine(str(tmp_path / "env.json"))["source"] == "recorded: env.json"
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "other.json").write_text(json.dumps({"schema": 7}))
    for name, words in [("missing.json", "does not exist"), ("bad.json", "cannot read"),
                        ("other.json", "not a hetrain machine description")]:
        with pytest.raises(UsageError) as e:
            driver.load_machine(str(tmp_path / name))
        assert words in e.value.what and e.value.fix


def test_the_child_process_query_runs_here():
    facts = driver.query_machine_in_subprocess(timeout_s=120)
    assert facts["schema"] == driver.SCHEMA and facts["source"] == "live"
    assert facts["versions"]["torch"] and facts["host"]["cpu_count"]


def test_a_lost_gpu_is_dropped_and_reported(monkeypatch):
    gpus = [FakeGpu(**{**A100, "uuid": f"GPU-{i}", "bus": f"00000000:0{i}:00.0"}) for i in range(3)]
    nv = fake_nvml.make(gpus, levels={(0, 2): 50})

    def handle(i):
        if i == 1:
            raise fake_nvml.NVMLError(15, "GPU is lost")
        return i

    nv.nvmlDeviceGetHandleByIndex = handle
    use(monkeypatch, nv)
    facts = driver.query_machine()
    assert [g["nvml_index"] for g in facts["gpus"]] == [0, 2]
    assert [(p["a"], p["b"], p["level"]) for p in facts["pairs"]] == [(0, 1, "SYS")]   # positions in gpus
    nvml = check(doctor.run_checks(machine.from_facts(facts)), "nvml")
    assert nvml.level == "warn" and "GPU 1: no NVML handle" in nvml.message


def _two_gpu_facts():
    gpus = [{"cuda_index": i, "nvml_index": i, "name": "NVIDIA GeForce RTX 4090", "uuid": f"gpu-{i}"} for i in (0, 1)]
    return {"gpus": gpus, "pairs": [{"a": 0, "b": 1, "level": "PHB", "nvlinks": 0, "p2p_reported": None,
                                     "p2p_verified": None, "p2p_error": None, "measured_gbs": None}],
            "torch": {"available": True}, "nvml": {"ok": True}, "env": {}, "versions": {}, "host": {}}


def test_a_hung_peer_copy_becomes_broken_p2p(monkeypatch):
    import subprocess

    import torch

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)

    def hang(args, environ, timeout_s):
        assert args == ["--peers-here"]
        raise subprocess.TimeoutExpired("python", timeout_s)

    monkeypatch.setattr(driver, "_run_child", hang)
    facts = _two_gpu_facts()
    driver._peer_checks_in_child(facts, measure=False, timeout_s=5)
    (pair,) = facts["pairs"]
    assert pair["p2p_reported"] and pair["p2p_verified"] is False and "did not finish in 5 s" in pair["p2p_error"]
    p2p = check(doctor.run_checks(machine.from_facts(facts)), "p2p")
    assert p2p.level == "error" and dict(p2p.env) == {"NCCL_P2P_DISABLE": "1"}


def test_the_copy_child_results_are_merged(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    child = _two_gpu_facts()
    child["pairs"][0].update(p2p_reported=True, p2p_verified=True, measured_gbs=24.5)
    child["gpus"][1]["h2d_gbs"] = 25.1
    monkeypatch.setattr(driver, "_run_child", lambda args, environ, timeout_s: child)
    facts = _two_gpu_facts()
    driver._peer_checks_in_child(facts, measure=True)
    assert facts["pairs"][0]["p2p_verified"] is True and facts["pairs"][0]["measured_gbs"] == 24.5
    assert facts["gpus"][1]["h2d_gbs"] == 25.1 and "h2d_gbs" not in facts["gpus"][0]
