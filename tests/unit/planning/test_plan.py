"""Plan files are input: Plan.from_json takes a plan that to_json wrote and refuses anything else
with a ValueError naming what is wrong (init(plan=...) turns it into one UsageError line)."""

from __future__ import annotations

import json

import pytest

from hetrain.planning.plan import DevicePlan, ExcludedDevice, Plan


def plan_dict() -> dict:
    plan = Plan(global_batch=8, note="n", predicted={"step_s": 0.1},
                devices=(DevicePlan(rank=0, device="a", speed=1.0, share=5, micro_batch=5, reasons=("why",)),
                         DevicePlan(rank=1, device="b", speed=0.6, share=3, micro_batch=2, max_micro_batch=2)),
                excluded=(ExcludedDevice(device="c", reason="slow", fix="faster"),))
    assert Plan.from_json(plan.to_json()) == plan
    return json.loads(plan.to_json())


def broken(path: str, value) -> str:
    data = plan_dict()
    *parents, key = path.split(".")
    target = data
    for p in parents:
        target = target[int(p)] if p.isdigit() else target[p]
    target[int(key) if key.isdigit() else key] = value
    return json.dumps(data)


@pytest.mark.parametrize("text, words", [
    ('"hello"', "must be a JSON object, not str"),          # was: AttributeError, a traceback
    ("null", "not NoneType"),
    ("[1, 2]", "not list"),
    ("[" * 5000, "nests too deeply"),                       # was: RecursionError
    (broken("devices.0.share", 5.0), "share=5.0"),           # float shares: were accepted, failing later
    (broken("devices.0.micro_batch", 2.5), "micro_batch=2.5"),
    (broken("global_batch", "8"), "global_batch='8'"),
    (broken("devices.1.speed", -1), "speed=-1"),
    (broken("devices.1.checkpointing", "yes"), "checkpointing='yes'"),
    (broken("devices.1.reasons", "why"), "reasons='why'"),
    (broken("devices.1.colour", "red"), "unknown fields ['colour']"),
    (broken("devices", {"0": {}}), "devices must be a JSON list"),
    (broken("devices.0", 7), "device 0 must be a JSON object"),
    (broken("excluded", [{"device": "c"}]), "has no 'reason'"),
    (broken("predicted", {"step_s": "fast"}), "predicted figures"),
    (broken("schema", 99), "schema 99"),
    (broken("layout_spec", "DataParallel"), "layout_spec='DataParallel' is not valid"),
    (broken("layout_spec", {"kind": "Mesh"}), "names no layout"),
    (broken("layout_spec", {"kind": "DataParallel", "sharding": "zero3"}), "is not a sharding"),
    (broken("layout_spec", {"kind": "Pipeline"}), "is not a 'dp' layout"),
])
def test_a_file_that_is_not_a_plan_is_a_value_error_naming_why(text, words):
    with pytest.raises(ValueError) as e:
        Plan.from_json(text)
    assert words in str(e.value)


def test_the_plans_own_checks_still_apply():
    with pytest.raises(ValueError, match="sum to"):
        Plan.from_json(broken("global_batch", 9))
    with pytest.raises(ValueError, match="ordered by rank"):
        Plan.from_json(broken("devices.1.rank", 5))


def test_the_plan_records_its_layout_object_and_older_plans_read_it_from_layout():
    """Schema 6 stores layout_spec.to_spec(obj); a schema 5 file (no record) still loads, and its
    layout_record() is what its `layout` says."""
    from hetrain.layout_spec import DataParallel, from_spec, to_spec
    from hetrain.planning.plan import SCHEMA

    data = plan_dict()
    assert SCHEMA == 6 and data["schema"] == 6 and data["layout_spec"] is None
    spec = to_spec(DataParallel(sharding="fsdp"))
    recorded = Plan.from_json(json.dumps({**data, "layout_spec": spec}))
    assert recorded.layout_spec == {"kind": "DataParallel", "sharding": "fsdp"}
    assert from_spec(recorded.layout_record()) == DataParallel(sharding="fsdp")
    old = {k: v for k, v in data.items() if k != "layout_spec"}
    assert Plan.from_json(json.dumps({**old, "schema": 5})).layout_record() == {"kind": "DataParallel"}
    hybrid = Plan(global_batch=8, layout="dp-pp", group=2, stage_blocks=(2, 2), schedule="gpipe", devices=tuple(
        DevicePlan(rank=r, device="d", speed=1.0, share=4, micro_batch=2) for r in range(4)))
    piped = {k: v for k, v in json.loads(hybrid.to_json()).items() if k != "layout_spec"}
    assert Plan.from_json(json.dumps({**piped, "schema": 5})).layout_record() == {
        "kind": "Pipeline", "stages": 2, "schedule": "gpipe"}
