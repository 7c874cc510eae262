"""A Plan is frozen to the bottom, and the plan in force has one writer (runtime/replan.adopt)
that checks it is for this job and refuses, at the next step, a plan changed in place."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest

from hetrain.errors import UsageError
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.runtime import replan
from hetrain.runtime.job import RunState


def two_rank_plan(**changes) -> Plan:
    devices = [DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=8, micro_batch=4, reasons=["even"])
               for r in range(2)]
    return Plan(global_batch=16, devices=devices, predicted={"step_s": 0.1},
                layout_spec={"kind": "DataParallel", "sharding": None}, **changes)


class FakeJob(SimpleNamespace):
    """What adopt reads of a job: its size, its config's batch, and its run state."""
    plan = property(lambda self: self.run.plan)
    plan_seal = property(lambda self: self.run.plan_seal)
    steps_done = property(lambda self: self.run.steps_done)


def a_job(world_size=2, global_batch=16):
    return FakeJob(world_size=world_size, config=SimpleNamespace(global_batch=global_batch),
                   run=RunState(steps_done=3))


def test_a_plan_built_from_lists_and_dicts_holds_tuples_and_refuses_changes_in_place():
    plan = two_rank_plan()
    assert isinstance(plan.devices, tuple) and isinstance(plan.devices[0].reasons, tuple)
    assert plan.predicted == {"step_s": 0.1} and plan.layout_spec["kind"] == "DataParallel"
    for change in (lambda: plan.predicted.update(step_s=1.0), lambda: plan.predicted.__setitem__("x", 1.0),
                   lambda: plan.layout_spec.pop("kind")):
        with pytest.raises(UsageError, match="plans are frozen"):
            change()
    hash(plan)                                 # every part immutable, so the plan hashes
    assert Plan.from_json(plan.to_json()) == plan == copy.deepcopy(plan) == pickle.loads(pickle.dumps(plan))


def test_adopt_checks_the_plan_is_for_this_job_and_seals_it():
    job, plan = a_job(), two_rank_plan()
    assert replan.adopt(job, plan, "planned") is plan and job.plan is plan
    replan.check_unchanged(job)                # unchanged: nothing to say
    with pytest.raises(UsageError, match="the given plan is for 2 device.s. and global batch 16, this job has 3"):
        replan.adopt(a_job(world_size=3), plan, "given")
    with pytest.raises(UsageError, match="global batch 16, this job has 2 and 32"):
        replan.adopt(a_job(global_batch=32), plan, "resumed")


@pytest.mark.parametrize("mutate", [
    lambda p: object.__setattr__(p.devices[1], "micro_batch", 1),
    lambda p: object.__setattr__(p, "compression", "fp16"),
    lambda p: dict.__setitem__(p.predicted, "step_s", 9.0),
], ids=["a device's field", "a plan's field", "a mapping, around its guard"])
def test_a_plan_changed_in_place_after_adoption_is_refused_in_one_line(mutate):
    job = a_job()
    replan.adopt(job, two_rank_plan(), "planned")
    mutate(job.plan)
    with pytest.raises(UsageError) as e:
        replan.check_unchanged(job)
    assert "changed in place" in e.value.what and "before step 3" in e.value.what
    assert "plans are frozen: make a new one with dataclasses.replace" in str(e.value)
    assert "\n" not in str(e.value)
