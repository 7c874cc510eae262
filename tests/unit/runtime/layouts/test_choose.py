"""What prepare(parallel=...) accepts, and the one-line errors for what it cannot run."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.runtime.layouts import checks, choose


def test_a_known_shorthand_is_taken():
    assert choose.requested("pp") == "pp"


@pytest.mark.parametrize("value", ["pipeline", "PP", "", 3, None])
def test_an_unknown_layout_is_one_line_naming_the_choices(value):
    with pytest.raises(UsageError) as e:
        choose.requested(value)
    assert "is not a layout" in e.value.what and "dp-pp" in e.value.fix and "Pipeline(" in e.value.fix
    if value == "pipeline":
        assert "did you mean" in e.value.what


@pytest.mark.parametrize("kind,world,needle", [
    ("tp", 1, "on one device"),
    ("tp", 2, None),
    ("dp", 1, None),
])
def test_a_layout_the_job_cannot_run_is_refused_before_anything_is_built(kind, world, needle):
    spec = choose.resolve(kind, None, world_size=world)[0]
    if needle is None:
        checks.check_request(spec, world_size=world)
        return
    with pytest.raises(UsageError) as e:
        checks.check_request(spec, world_size=world)
    assert needle in e.value.what and e.value.fix


def _plan(layout, group=1, world=2, **kw):
    return Plan(global_batch=8, layout=layout, group=group, devices=tuple(
        DevicePlan(rank=r, device="d", speed=1.0, share=8 if group == world else 4, micro_batch=4)
        for r in range(world)), **kw)


def test_shorthands_and_plans_resolve_to_layout_objects_in_one_place():
    from hetrain import DataParallel, Pipeline, TensorParallel

    def resolve(parallel, plan):
        return choose.resolve(parallel, plan, world_size=2)

    assert resolve("dp", None) == (DataParallel(), None)
    assert resolve("tp", None) == (TensorParallel(), None)
    assert resolve("pp", None) == (Pipeline(), None)
    assert resolve("dp-pp", None) == (Pipeline(stages="auto"), None)
    assert resolve("auto", None) == ("auto", None)
    plan = _plan("tp", group=2)
    assert resolve(plan, None) == (TensorParallel(), plan)
    assert resolve("auto", plan) == (TensorParallel(), plan)       # init(plan=...) decides when prepare asks for auto
    assert resolve(plan, _plan("dp")) == (TensorParallel(), plan)  # prepare's plan is the one for this prepare
    own = Pipeline(stages=2, micro_batches=4, schedule="gpipe")
    assert resolve(own, None) == (own, None)


def test_a_layout_object_that_agrees_with_the_plan_takes_its_open_fields():
    from hetrain import DataParallel, Pipeline

    pp = _plan("pp", group=2, stage_blocks=(1, 1), schedule="gpipe")
    assert choose.resolve(Pipeline(schedule="gpipe"), pp, world_size=2)[0] == Pipeline(schedule="gpipe")
    assert choose.resolve(Pipeline(stages=2, schedule="gpipe"), pp, world_size=2)[0] == \
        Pipeline(schedule="gpipe")      # two stages on two devices is one pipeline
    hybrid = _plan("dp-pp", group=2, world=4, stage_blocks=(1, 1), schedule="1f1b")
    assert choose.resolve(Pipeline(stages="auto"), hybrid, world_size=4)[0] == Pipeline(stages=2)
    assert choose.resolve(DataParallel(sharding="fsdp"), _plan("dp"), world_size=2)[0] == \
        DataParallel(sharding="fsdp")


@pytest.mark.parametrize("asked, layout, group, world, planned", [
    ("DataParallel(sharding='fsdp')", "pp", 2, 2, "the plan is for Pipeline(stages=None, schedule='1f1b')"),
    ("Pipeline(stages=2)", "dp", 1, 2, "the plan is for DataParallel()"),
    ("'tp'", "dp", 1, 2, "the plan is for DataParallel()"),
    ("Pipeline()", "dp-pp", 2, 4, "the plan is for Pipeline(stages=2, schedule='1f1b')"),
    ("Pipeline(stages='auto')", "pp", 2, 2, "the plan is for Pipeline(stages=None"),
    ("Pipeline(schedule='gpipe')", "pp", 2, 2, "schedule='1f1b'"),
])
def test_a_plan_for_another_layout_is_refused_with_both_named(asked, layout, group, world, planned):
    """Never re-planned or run silently as another layout: one line naming the plan's layout and
    what prepare() asked for, with the fix (drop one, or re-plan)."""
    from hetrain import DataParallel, Pipeline, TensorParallel

    objects = {"DataParallel": DataParallel, "Pipeline": Pipeline, "TensorParallel": TensorParallel}
    piped = layout in ("pp", "dp-pp")
    given = _plan(layout, group=group, world=world, stage_blocks=(1,) * group if piped else (),
                  schedule="1f1b" if piped else "")
    with pytest.raises(UsageError) as e:
        choose.resolve(eval(asked, objects), given, world_size=world)
    assert planned in e.value.what and f"but prepare(parallel={eval(asked, objects)!r})" in e.value.what
    assert "drop one of them" in e.value.fix and "re-plan" in e.value.fix


@pytest.mark.parametrize("kwargs,needle,fix", [
    (dict(stages=0), "2 or more stages", "stages=2 or more"),
    (dict(stages=1), "2 or more stages", "stages=2 or more"),
    (dict(stages=-3), "2 or more stages", "stages=None"),
    (dict(stages="two"), "whole number", "stages='auto'"),
    (dict(stages=2.0), "whole number", "stages=2 or more"),
    (dict(stages=True), "whole number", "stages=2 or more"),
    (dict(micro_batches=0), "1 or more micro-batches", "micro_batches=1 or more"),
    (dict(schedule="zb"), "is not a schedule", "gpipe, 1f1b"),
])
def test_an_impossible_pipeline_is_refused_when_made_with_the_reason_and_the_fix(kwargs, needle, fix):
    from hetrain import Pipeline

    with pytest.raises(UsageError) as e:
        Pipeline(**kwargs)
    assert needle in e.value.what and fix in e.value.fix, (e.value.what, e.value.fix)


def test_bad_data_and_tensor_layouts_are_refused_when_made():
    from hetrain import DataParallel, TensorParallel

    with pytest.raises(UsageError, match="not a sharding"):
        DataParallel(sharding="zero3")
    with pytest.raises(UsageError, match="not a split"):
        TensorParallel(split="fast")
    with pytest.raises(TypeError):
        DataParallel("fsdp")                 # keyword-only
    assert DataParallel(sharding="capacity-full").sharding == "capacity-full"


@pytest.mark.parametrize("spec,loss_fn,world,needle", [
    (dict(), None, 2, "needs the loss function"),
    (dict(), len, 1, "on one device"),
    (dict(stages=4), len, 2, "4 stages need 4 devices"),
    (dict(stages=3), len, 4, "do not form pipelines of 3 stages"),
    (dict(stages="auto"), len, 2, "replicas of 2+ stages"),
    (dict(stages=2), len, 4, None),
    (dict(stages=2), len, 2, None),
    (dict(stages="auto"), len, 6, None),
])
def test_a_pipeline_the_job_cannot_run_is_refused_when_prepare_sees_the_job(spec, loss_fn, world, needle):
    from hetrain import Pipeline

    if needle is None:
        checks.check_pipeline(Pipeline(**spec), loss_fn=loss_fn, world_size=world)
        return
    with pytest.raises(UsageError) as e:
        checks.check_pipeline(Pipeline(**spec), loss_fn=loss_fn, world_size=world)
    assert needle in e.value.what and e.value.fix


def test_a_pipeline_over_every_device_or_replicas_of_fewer_stages():
    from hetrain import Pipeline

    assert Pipeline().kind_for(4) == "pp" and Pipeline(stages=4).kind_for(4) == "pp"
    assert Pipeline(stages=2).kind_for(4) == "dp-pp" and Pipeline(stages="auto").kind_for(4) == "dp-pp"


def test_every_ranking_row_family_maps_to_a_layout_object():
    from hetrain import DataParallel, Pipeline, TensorParallel
    from dataclasses import replace

    from hetrain.planning.chooser import spec_of
    from hetrain.planning.ranking import ORDER, LayoutRow

    def row(name, family):
        return LayoutRow(name=name, family=family, fits=True, samples_per_s=1.0, memory=(None,), comm_bytes=0.0,
                         comm_s=0.0, detail="", run="")

    def spec(r):      # what rank_layouts records on each row: the row says what runs
        return replace(r, spec=spec_of(r))

    names = {"PP": "PP 4 stages", "DP×PP": "DP×PP 2×3", "TP": "TP 4", "TP by speed": "TP by speed"}
    got = {family: choose.layout_for(spec(replace(row(names.get(family, family), family),
                                                  stages=3 if family == "DP×PP" else None))) for family in ORDER}
    assert got == {"DP": DataParallel(sharding="none"), "DP + ZeRO-1": DataParallel(sharding="zero1"),
                   "DP + capacity": DataParallel(sharding="capacity"), "FSDP2": DataParallel(sharding="fsdp"),
                   "capacity-full": DataParallel(sharding="capacity-full"), "PP": Pipeline(),
                   "DP×PP": Pipeline(stages=3), "TP": TensorParallel(), "TP by speed": TensorParallel(split="speed")}


def test_the_recommendation_leaves_tensor_parallelism_out_while_oom_recovery_is_on():
    from hetrain.planning.chooser import Request
    from hetrain.planning.ranking import LayoutRanking, LayoutRow
    from hetrain.runtime.measure.measurements import recommended

    def row(name, family, sps, fits=True):
        return LayoutRow(name=name, family=family, fits=fits, samples_per_s=sps, memory=(None,), comm_bytes=0.0,
                         comm_s=0.0, detail="", run=f"run {name}")

    tp, pp, dp = row("TP 2 by speed", "TP by speed", 300.0), row("PP 2 stages", "PP", 200.0), row("DP", "DP", 195.0)
    ranking = LayoutRanking(rows=(tp, pp, dp), devices=("a", "b"), capacity=(None, None), best=tp, why="")
    got = recommended(ranking)
    assert got.best == dp and "TP 2 by speed predicts 300.0" in got.why       # DP: simpler, within 5% of PP
    assert any("TP 2 by speed left out" in line and "OOM recovery" in line for line in got.left_out)
    assert recommended(got).best is got.best                                # the same rule: the same answer
    assert recommended(ranking, Request(oom_recovery=False)).best == tp     # TP may run when it wins
    alone = LayoutRanking(rows=(tp, row("DP", "DP", 0.0, fits=False)), devices=("a", "b"), capacity=(None, None),
                          best=tp, why="")
    assert recommended(alone).best is None
    no_pipes = recommended(replace_best(ranking, pp), Request(has_loss_fn=False))
    assert no_pipes.best == dp and any(line.startswith("PP 2 stages left out: no loss_fn") for line in no_pipes.left_out)


def replace_best(ranking, best):
    from dataclasses import replace

    return replace(ranking, best=best)
