"""The data-parallel plan as tensor parallelism runs it (runtime/layouts/data_setup.tensor_plan):
every rank computes the whole batch, in the micro-batch the layout ranking's TP rows cost
(planning/tensor_split.tp_micro_batch), so `hetrain plan` and the run agree; a device that cannot
hold its part is refused with the reason and the fix."""

from __future__ import annotations

import re

import pytest

from hetrain.errors import UsageError
from hetrain.planning.ranking import ModelState, rank_layouts
from hetrain.planning.planner import PlanOptions, make_plan
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.layouts.data_setup import tensor_plan

GiB = 2**30


def _profiles(memories, act=0.25 * GiB):
    return [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.001, per_sample_s=0.01 / s,
                          fixed_bytes=8 * GiB, activation_bytes_per_sample=act, activation_fixed_bytes=0.5 * GiB,
                          memory_bytes=m)
            for i, (s, m) in enumerate(zip([1.0, 0.5], memories))]


def _micro(row) -> int:
    return int(re.search(r"micro-batch (\d+)x", row.detail).group(1))


@pytest.mark.parametrize("memories", [(20 * GiB, 10 * GiB), (80 * GiB, 24 * GiB), (None, None)])
@pytest.mark.parametrize("split, family", [("speed", "TP by speed"), ("even", "TP")])
def test_the_run_takes_the_micro_batch_the_ranking_costed(memories, split, family):
    profiles = _profiles(memories)
    o = PlanOptions(global_batch=64, grad_bytes=GiB, memory_margin=0.1)
    plan = make_plan(profiles, o)
    tp = tensor_plan(plan, profiles, split=split, margin=0.1, limit=None)
    ranking = rank_layouts(profiles, state=ModelState(params=GiB // 2, trainable=GiB // 2), options=o)
    row = next(r for r in ranking.rows if r.family == family)
    assert tp.layout == "tp" and tp.group == 2
    assert {d.share for d in tp.devices} == {64}
    # the layers are cut by each rank's rate a sample, as the ranking cuts them (not the DP shares' rate)
    assert [d.speed for d in tp.devices] == pytest.approx([1.0, 0.5])
    assert {d.micro_batch for d in tp.devices} == {_micro(row)}
    # the data-parallel plan's micro-batches were its shares, smaller than what TP runs here
    assert max(d.micro_batch for d in plan.devices) < _micro(row) or memories[0] == 20 * GiB


def test_the_users_cap_and_a_given_plan_bound_the_micro_batch():
    profiles = _profiles((80 * GiB, 24 * GiB))
    plan = make_plan(profiles, PlanOptions(global_batch=64, grad_bytes=GiB))
    assert {d.micro_batch for d in tensor_plan(plan, profiles, split="speed", margin=0.1, limit=8).devices} == {8}
    # a plan given to the job (no profiles): its caps held the whole model, a shard holds less
    given = tensor_plan(plan, None, split="speed", margin=0.1, limit=None)
    assert {d.micro_batch for d in given.devices} == {min(64, *(d.max_micro_batch for d in plan.devices))}


def test_a_device_that_cannot_hold_its_part_is_refused_with_the_fix():
    profiles = _profiles((80 * GiB, 24 * GiB))
    plan = make_plan(profiles, PlanOptions(global_batch=64, grad_bytes=GiB))
    small = [DeviceProfile(**{**p.__dict__, "memory_bytes": 3 * GiB}) for p in profiles]
    with pytest.raises(UsageError) as e:
        tensor_plan(plan, small, split="speed", margin=0.1, limit=None)
    assert "dev0" in e.value.what and "67%" in e.value.what and "parallel='pp'" in e.value.fix
