"""Device records for CUDA GPUs (known and unknown), the CPU and emulated devices; links; arch."""

import pytest

from hetrain.hardware import catalog, devices, machine
from hetrain.hardware.checks_software import arch_support
from hetrain.hardware.cluster import parse_cluster
from hetrain.hardware.topology import PCIE_LANE_GBS, links, matrix


def test_unknown_gpu_keeps_the_drivers_facts_and_a_note():
    d = devices.gpu_from_record({"cuda_index": 0, "name": "NVIDIA GeForce RTX 4070", "memory_bytes": 12878086144,
                                 "compute_capability": [8, 9]}, source="test")
    assert d.spec is None and not d.in_catalog
    assert (d.memory_bytes, d.compute_capability, d.real_bf16, d.datacenter) == (12878086144, (8, 9), True, None)
    assert "not in hetrain's GPU catalog" in d.notes[0] and "RTX 4070" in d.notes[0]
    assert d.to_dict()["spec"] is None


def test_known_gpu_uses_the_driver_memory_and_the_catalog_class():
    d = devices.gpu_from_record({"cuda_index": 1, "nvml_index": 0, "name": "NVIDIA GeForce RTX 3090",
                                 "memory_bytes": 25438715904, "compute_capability": [8, 6]}, source="test")
    assert d.spec.key == "rtx3090" and d.memory_bytes == 25438715904 and d.datacenter is False
    assert d.label == "cuda:1" and d.summary() == "cuda:1 NVIDIA GeForce RTX 3090, 23.7 GiB, cc 8.6"


def test_hidden_gpu_is_labelled_by_its_nvidia_smi_index():
    d = devices.gpu_from_record({"cuda_index": None, "nvml_index": 3, "name": "NVIDIA L4"}, source="test")
    assert not d.visible and d.label == "gpu3 (hidden)"
    assert d.memory_bytes == catalog.resolve("l4").memory_bytes          # catalog fills what NVML lacked


def test_cpu_only_machine_is_one_cpu_device():
    (d,) = devices.devices_from_facts({"host": {"cpu": "AMD EPYC", "cpu_count": 2}, "gpus": []})
    assert (d.kind, d.label, d.name, d.is_gpu, d.real_bf16) == ("cpu", "cpu", "AMD EPYC", False, None)


def test_cluster_devices_become_planned_devices():
    a100, rtx = (c.to_device() for c in parse_cluster("a100-80g,rtx3090:0.5@1GiB"))
    assert (a100.kind, a100.label, a100.speed, a100.memory_bytes) == ("planned", "a100-80g#0", 1.0, 80 * 2**30)
    assert (rtx.label, rtx.speed, rtx.memory_bytes, rtx.power_limit_w) == ("rtx3090#1", 0.5, 2**30, 350)
    assert "given cap" in rtx.source


def test_device_rejects_an_unknown_kind():
    with pytest.raises(ValueError):
        devices.Device(kind="tpu", index=0, name="x")


def test_planned_cluster_machine():
    m = machine.planned("2x4090")
    assert m.planned and [d.label for d in m.gpus] == ["rtx4090#0", "rtx4090#1"] and m.links == ()


def test_pcie_estimate_is_the_slower_end():
    facts = {"gpus": [{"cuda_index": 0, "name": "NVIDIA A100 80GB PCIe", "pcie_gen_max": 4, "pcie_width": 16},
                      {"cuda_index": 1, "name": "NVIDIA GeForce RTX 3090", "pcie_gen_max": 4, "pcie_width": 8}],
             "pairs": [{"a": 0, "b": 1, "level": "SYS", "nvlinks": 0, "p2p_reported": False}]}
    devs = devices.devices_from_facts(facts)
    (ln,) = links(devs, facts)
    assert ln.kind == "cross-socket" and ln.estimated_gbs == round(PCIE_LANE_GBS[4] * 8, 1)
    assert "host memory" in ln.estimate_basis and "CPU interconnect" in ln.estimate_basis
    assert matrix(devs, (ln,)) == [["", "cuda:0", "cuda:1"], ["cuda:0", "X", "SYS p2p:NO"], ["cuda:1", "SYS p2p:NO", "X"]]


@pytest.mark.parametrize("cc,arch,expected", [
    ((8, 9), ["sm_80", "sm_86", "sm_90"], "sass"),      # sm_86 binaries run on 8.9
    ((8, 6), ["sm_80", "sm_90"], "sass"),
    ((12, 0), ["sm_80", "sm_86", "sm_90"], None),       # the RTX 50xx trap
    ((12, 0), ["sm_90", "compute_90"], "ptx"),          # JIT from PTX
    ((9, 0), ["sm_80", "sm_90a"], "sass"),
    ((9, 1), ["sm_90a"], None),                          # arch-specific binaries only run on their own cc
    ((7, 0), ["sm_75", "sm_80"], None),
    ((12, 0), ["sm_100", "sm_120"], "sass"),
])
def test_arch_support(cc, arch, expected):
    assert arch_support(cc, arch) == expected
