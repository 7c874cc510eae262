"""The runtime's planning step: what it tells people about emulated devices it cannot emulate well."""

from __future__ import annotations

from hetrain.hardware.cluster import parse_cluster
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.joint_plan import _warn_slow_cpu_precision


def profile(precision: str, cpu_per_sample: float, speed: float) -> DeviceProfile:
    return DeviceProfile(device="x", source="test", overhead_s=0.001, per_sample_s=cpu_per_sample / speed,
                         fixed_bytes=0, activation_bytes_per_sample=0.0, precision=precision)


def test_an_emulated_fp16_device_is_named_with_how_much_slower_the_cpu_runs_it():
    specs = list(parse_cluster("a100-80g:1.0,t4:0.35"))
    said = []
    _warn_slow_cpu_precision(said.append, [profile("bf16", 0.003, 1.0), profile("fp16", 0.048, 0.35)], specs)
    assert len(said) == 1
    assert "t4#1" in said[0] and "16x slower" in said[0] and "precision='fp32'" in said[0]
    assert "a100" not in said[0]


def test_one_precision_everywhere_says_nothing():
    specs = list(parse_cluster("a100-80g:1.0,rtx3090:0.67"))
    said = []
    _warn_slow_cpu_precision(said.append, [profile("bf16", 0.003, 1.0), profile("bf16", 0.003, 0.67)], specs)
    assert said == []
