"""benchmarks/host_drift.py: the host's drift timed with the accuracy benchmarks' own model (its
forward and backward) as well as with matmuls, and bad input as a usage error."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def drift(benchmark_module):
    return benchmark_module("host_drift")


class Box:
    def put(self, value):
        self.value = value


@pytest.mark.parametrize("model", [None, ("1,32,16", "fp32")])
def test_each_workload_is_counted_window_by_window(drift, model, monkeypatch):
    if model:
        monkeypatch.setenv("HETRAIN_LAYOUT_ACCURACY_MODEL", model[0])   # _workload sets it; restored after
    box = Box()
    drift.rates(0.6, 0.2, 0.0, box, model)
    assert len(box.value) >= 2 and all(rate > 0 for rate in box.value)


def test_the_model_workload_is_the_benchmarks_model_in_its_precision(drift):
    assert drift.describe(None) == "fp32 512x512 matmuls"
    assert drift.describe(("4,128,64", "bf16")) == "the model's forward+backward (4,128,64, 16 samples, bf16)"


@pytest.mark.parametrize("argv", [["--model", "4,128"], ["--model", "a,b,c"], ["--seconds", "1", "--window", "2"]])
def test_bad_input_is_a_usage_error(drift, argv, tmp_path, capsys):
    assert drift.main(["--json", os.fspath(tmp_path / "x.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert "host_drift:" in err and "e.g." in err
