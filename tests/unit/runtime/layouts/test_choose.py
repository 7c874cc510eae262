"""What prepare(parallel=...) accepts, and the one-line errors for what it cannot run."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.planning.pipeline_split import StageDevice
from hetrain.runtime.layouts import choose


def test_a_known_layout_or_a_plans_layout_is_taken():
    assert choose.requested("pp", None) == "pp"
    plan = Plan(global_batch=8, layout="tp", group=2, devices=tuple(
        DevicePlan(rank=r, device="d", speed=1.0, share=8, micro_batch=4) for r in range(2)))
    assert choose.requested(plan, None) == "tp"
    assert choose.requested("auto", plan) == "tp"        # init(plan=...) decides when prepare asks for auto


@pytest.mark.parametrize("value", ["pipeline", "PP", "", 3, None])
def test_an_unknown_layout_is_one_line_naming_the_choices(value):
    with pytest.raises(UsageError) as e:
        choose.requested(value, None)
    assert "is not a layout" in e.value.what and "dp-pp" in e.value.fix
    if value == "pipeline":
        assert "did you mean" in e.value.what


@pytest.mark.parametrize("kind,loss_fn,world,needle", [
    ("pp", None, 2, "needs the loss function"),
    ("dp-pp", None, 4, "needs the loss function"),
    ("pp", len, 1, "on one device"),
    ("tp", None, 1, "on one device"),
    ("dp-pp", len, 2, "replicas of 2+ stages"),
    ("dp-pp", len, 6, None),
    ("dp", None, 1, None),
])
def test_a_layout_the_job_cannot_run_is_refused_before_anything_is_built(kind, loss_fn, world, needle):
    if needle is None:
        choose.check_request(kind, loss_fn=loss_fn, world_size=world)
        return
    with pytest.raises(UsageError) as e:
        choose.check_request(kind, loss_fn=loss_fn, world_size=world)
    assert needle in e.value.what and e.value.fix


def test_the_whole_state_fitting_every_device_is_decided_without_measuring():
    import torch

    model = torch.nn.Linear(100, 100)        # 40.4 KB of parameters, ×4 with AdamW: ~162 KB
    roomy = [StageDevice(name="a", speed=1.0, memory_bytes=1e6), StageDevice(name="b", speed=0.5, memory_bytes=4e5)]
    fits, why = choose.state_fits(model, roomy, factor=4.0, margin=0.1)
    assert fits and "fits every device" in why and "b" in why
    tight = [roomy[0], StageDevice(name="b", speed=0.5, memory_bytes=2e5)]
    assert choose.state_fits(model, tight, factor=4.0, margin=0.1) == (False, "")
    uncapped = [StageDevice(name="a", speed=1.0, memory_bytes=None)] * 2
    assert choose.state_fits(model, uncapped, factor=4.0, margin=0.1)[0]
