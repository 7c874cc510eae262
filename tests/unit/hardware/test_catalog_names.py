"""The GPU catalog: names from drivers and users resolve; unknown GPUs degrade to None."""

import pytest

from hetrain.errors import UsageError
from hetrain.hardware import catalog

# What torch.cuda.get_device_name / NVML return on real machines -> catalog key.
DRIVER_NAMES = {
    "NVIDIA A100-SXM4-80GB": "a100-80g",
    "NVIDIA A100-SXM4-40GB": "a100-40g",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80g",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40g",
    "NVIDIA A800-SXM4-80GB": "a800-80g",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H800": "h800",
    "NVIDIA H200": "h200",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA L4": "l4",
    "NVIDIA A10": "a10",
    "NVIDIA A40": "a40",
    "NVIDIA A30": "a30",
    "NVIDIA RTX A6000": "rtx-a6000",
    "NVIDIA GeForce RTX 3090": "rtx3090",
    "NVIDIA GeForce RTX 3090 Ti": "rtx3090ti",
    "NVIDIA GeForce RTX 3080": "rtx3080",
    "NVIDIA GeForce RTX 4080": "rtx4080",
    "NVIDIA GeForce RTX 4090": "rtx4090",
    "NVIDIA GeForce RTX 5090": "rtx5090",
    "NVIDIA GeForce RTX 2080 Ti": "rtx2080ti",
    "Tesla V100-SXM2-32GB": "v100-32g",
    "Tesla V100-SXM2-16GB": "v100-16g",
    "Tesla V100-PCIE-32GB": "v100-pcie-32g",
    "Tesla T4": "t4",
    "Tesla P100-PCIE-16GB": "p100",
}


@pytest.mark.parametrize("name,key", sorted(DRIVER_NAMES.items()))
def test_driver_names_resolve(name, key):
    assert catalog.lookup(name).key == key


@pytest.mark.parametrize("alias,key", [("a100-80g", "a100-80g"), ("a100", "a100-80g"), ("3090", "rtx3090"),
                                       ("rtx3090", "rtx3090"), ("RTX-3090", "rtx3090"), ("4090", "rtx4090"),
                                       ("v100", "v100-32g"), ("h100", "h100-sxm"), ("t4", "t4")])
def test_aliases_resolve(alias, key):
    assert catalog.resolve(alias).key == key


def test_the_seed_speed_ratio_is_kept():
    assert catalog.resolve("a100-80g").speed_index == 1.0
    assert catalog.resolve("rtx3090").speed_index == 0.67


def test_a_near_name_is_not_matched_to_a_different_card():
    # A 3090 Ti is not a 3090, and an unknown card is unknown: a wrong match would give wrong speed/memory.
    assert catalog.lookup("NVIDIA GeForce RTX 3090 Ti").key != "rtx3090"
    assert catalog.lookup("NVIDIA GeForce RTX 4070") is None
    assert catalog.lookup("NVIDIA RTX 4000 Ada Generation") is None
    assert catalog.lookup("") is None


def test_mig_slice_resolves_to_its_parent_card():
    assert catalog.lookup("NVIDIA A100-SXM4-40GB MIG 1g.5gb").key == "a100-40g"


def test_resolve_unknown_is_a_usage_error_with_close_names():
    with pytest.raises(UsageError) as e:
        catalog.resolve("rtx3909")
    assert "unknown GPU 'rtx3909'" in e.value.what and "rtx3090" in e.value.what
    assert e.value.fix


def test_no_two_cards_share_a_name():
    seen = {}
    for spec in catalog.all_gpus():
        for label in {catalog.normalize(x) for x in (spec.key, spec.name, *spec.aliases, *spec.names)}:
            assert label not in seen, f"{label!r} names both {seen[label]} and {spec.key}"
            seen[label] = spec.key


def test_every_entry_is_consistent():
    for s in catalog.all_gpus():
        assert s.fp32_tflops > 0 and s.memory_bytes > 0 and s.tdp_w > 0, s.key
        assert (s.fp16_tflops > 0) == s.fp16, s.key
        assert s.bandwidth_gbs > 0 and 3 <= s.pcie_gen <= 5 and s.speed_index > 0, s.key
        if s.vendor == "nvidia":   # bf16 tensor throughput exactly where the hardware has bf16 (cc >= 8.0)
            assert s.bf16 is None and s.fp16, s.key
            assert (s.bf16_tflops > 0) == s.real_bf16 == (s.compute_capability >= (8, 0)), s.key
        else:                      # no compute capability: the explicit flag says it
            assert s.compute_capability == (0, 0) and s.bf16 is not None, s.key
            assert (s.bf16_tflops > 0) == s.real_bf16 == s.bf16, s.key
        assert s.names, f"{s.key}: no driver-reported name"


def test_the_issue_list_is_covered():
    wanted = ["a100-80g", "a100-40g", "a100-pcie-80g", "a100-pcie-40g", "h100-sxm", "h100-pcie", "h200",
              "l40s", "l4", "a10", "rtx-a6000", "rtx3090", "rtx4090", "v100-32g", "v100-16g", "v100-pcie-32g",
              "t4", "a800-80g", "h800", "rtx3080", "rtx3090ti", "rtx4080", "rtx5090", "l40", "a40", "a30",
              "p100", "rtx2080ti"]
    keys = {s.key for s in catalog.all_gpus()}
    assert not set(wanted) - keys


def test_datasheet_spot_checks():
    a100 = catalog.resolve("a100-80g")
    assert (a100.bf16_tflops, a100.memory_bytes, a100.compute_capability, a100.nvlink_gbs) == (312, 80 * 2**30, (8, 0), 600)
    assert catalog.resolve("v100").bf16_tflops == 0 and not catalog.resolve("t4").real_bf16
    assert catalog.resolve("5090").compute_capability == (12, 0)
    assert catalog.resolve("4090").datacenter is False and catalog.resolve("l40s").datacenter is True
