"""The runtime's planning step: what it tells people about emulated devices it cannot emulate well."""

from __future__ import annotations

import pytest
import torch

from hetrain.hardware.cluster import parse_cluster
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.agree import Table
from hetrain.runtime.joint_plan import SYNC_RUNS, _straggle, _warn_slow_cpu_precision


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


def test_straggle_is_the_median_run_of_how_far_the_last_rank_trails_the_mean():
    keys = [f"compute_{k}" for k in range(SYNC_RUNS)]
    # Three ranks; rank 2 is last in every run, by a different amount each time: with the others
    # at 1 and rank 2 at v, it trails the mean (2 + v)/3 by 3v/(2 + v) − 1. v = 7/4 is 40%.
    last = [1.0, 1.25, 1.75, 2.5, 4.0]                       # the middle run, by how far it trails: 7/4
    rows = [[1.0] * SYNC_RUNS, [1.0] * SYNC_RUNS, last[:SYNC_RUNS]]
    table = Table(keys, torch.tensor(rows, dtype=torch.float64))
    assert _straggle(table) == pytest.approx(0.4)
    zeros = Table(keys, torch.zeros(3, SYNC_RUNS, dtype=torch.float64))     # not timed (a GPU)
    assert _straggle(zeros) == 0.0
