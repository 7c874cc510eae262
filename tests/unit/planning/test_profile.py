"""Profiles: the linear fit, memory sizing, JSON, and bad numbers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.planning.profile import DeviceProfile, ModelSpec, fit_linear

MIB = 1024**2


def profile(**kw) -> DeviceProfile:
    base = dict(device="gpu", source="test", overhead_s=0.002, per_sample_s=0.01, fixed_bytes=100 * MIB,
                activation_bytes_per_sample=10 * MIB, memory_bytes=1024 * MIB)
    return DeviceProfile(**{**base, **kw})


@settings(max_examples=100, deadline=None)
@given(a=st.floats(0.0, 0.1), b=st.floats(1e-5, 0.1))
def test_fit_recovers_a_line(a, b):
    sizes = [1, 2, 4, 8, 16, 32]
    fa, fb = fit_linear(sizes, [a + b * s for s in sizes])
    assert fa == pytest.approx(a, rel=1e-6, abs=1e-9)
    assert fb == pytest.approx(b, rel=1e-6)


def test_fit_never_returns_a_negative_intercept():
    a, b = fit_linear([1, 2, 4], [0.5, 1.5, 3.5])      # the line through them crosses below zero
    assert a == 0.0 and b > 0
    assert fit_linear([4], [0.8]) == (0.0, pytest.approx(0.2))


def test_time_and_memory_of_a_micro_batch():
    p = profile(activation_fixed_bytes=4 * MIB, checkpoint_fraction=0.25)
    assert p.micro_seconds(10) == pytest.approx(0.102)
    assert p.micro_seconds(10, checkpointing=True) == pytest.approx(0.102 * 4 / 3)
    assert p.memory_needed(3) == 100 * MIB + 4 * MIB + 30 * MIB
    assert p.memory_needed(3, checkpointing=True) == pytest.approx(100 * MIB + 0.25 * 34 * MIB)
    # 1024 MiB, 10% free: 921.6 − 100 − 4 = 817.6 MiB for 10 MiB samples -> 81
    assert p.max_micro_batch(margin=0.1) == 81
    assert p.max_micro_batch(margin=0.1, checkpointing=True) == int((921.6 - 100 - 1) // 2.5)
    assert profile(memory_bytes=None).max_micro_batch(margin=0.1) is None
    assert profile(memory_bytes=105 * MIB).max_micro_batch(margin=0.0) == 0


def test_json_round_trip_and_schema():
    p = profile(sizes=(1, 2, 4), seconds=(0.012, 0.022, 0.042), gpu="a100-80g", cpu_share=0.5, link_gbs=24.0)
    assert DeviceProfile.from_json(p.to_json()) == p
    bad = json.loads(p.to_json())
    bad["schema"] = 99
    with pytest.raises(ValueError, match="schema"):
        DeviceProfile.from_dict(bad)


@pytest.mark.parametrize("field, value", [("per_sample_s", 0.0), ("per_sample_s", -1.0), ("overhead_s", -0.1),
                                          ("memory_bytes", 0), ("precision", "fp8"), ("cpu_share", 1.5),
                                          ("per_sample_s", float("nan"))])
def test_bad_profile_numbers_are_usage_errors(field, value):
    with pytest.raises(UsageError):
        profile(**{field: value})


@pytest.mark.parametrize("kw", [dict(params=0), dict(params=-5), dict(flops_per_sample=0.0),
                                dict(activation_bytes_per_sample=-1.0), dict(checkpoint_fraction=0.0)])
def test_bad_model_specs_name_the_fix(kw):
    base = dict(name="m", params=10, flops_per_sample=1e9, activation_bytes_per_sample=1e6)
    with pytest.raises(UsageError) as e:
        ModelSpec(**{**base, **kw})
    assert e.value.fix
