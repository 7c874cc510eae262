"""The compact plan's summary line (runtime/measure/joint.plan_summary): the predicted samples/s and
what bounds the step, the largest of its predicted parts, with each part's share of the step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetrain.runtime.measure.joint import plan_summary


def plan(**predicted):
    devices = (SimpleNamespace(device="a100-80g#0", predicted_compute_s=0.010),
               SimpleNamespace(device="rtx3090#1", predicted_compute_s=0.012))
    return SimpleNamespace(predicted=predicted, devices=devices)


@pytest.mark.parametrize("parts, bound", [
    ({"compute_s": 0.060, "comm_exposed_s": 0.030, "optimizer_s": 0.010}, "compute on rtx3090#1"),
    ({"compute_s": 0.030, "comm_exposed_s": 0.060, "optimizer_s": 0.010}, "gradient sync"),
    ({"compute_s": 0.020, "comm_exposed_s": 0.010, "agree_s": 0.070}, "agreement"),
])
def test_the_largest_part_of_the_step_bounds_it(parts, bound):
    line = plan_summary(plan(samples_per_s=640.0, step_s=0.1, **parts))
    assert line.startswith(f"predicted 640.0 samples/s, bound by {bound}: a 100.0 ms step is "), line
    for key, name in (("compute_s", "compute"), ("comm_exposed_s", "gradient sync"), ("agree_s", "agreement")):
        if key in parts:
            assert f"{parts[key] / 0.1:.0%} {name}" in line, line
    assert "stragglers" not in line                 # a part the plan does not predict is not named


def test_a_plan_without_the_parts_says_its_rate_and_step():
    assert plan_summary(plan(samples_per_s=100.0, step_s=0.32)) == "predicted 100.0 samples/s (a 320.0 ms step)"
    assert plan_summary(plan()) == "predicted: no figure for this plan"
