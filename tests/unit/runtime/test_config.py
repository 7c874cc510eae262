"""Config, its groups and init(): every bad keyword or value is a UsageError naming it and the fix,
raised before anything joins a process group; a word from another tool names where the setting
lives in hetrain."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields

import pytest

import hetrain
from hetrain import Checkpoints, Compression, Memory, Rebalancing, Reporting
from hetrain.emulation import Emulation
from hetrain.errors import UsageError
from hetrain.runtime.config import LAUNCH_ENV, WHERE, Config, make_config
from hetrain.runtime.config_groups import GROUPS
from hetrain.runtime.engine import init


@pytest.mark.parametrize("kwargs, words, fix", [
    ({"global_batch": -1}, "global_batch=-1", "global_batch=N"),
    ({"global_batch": True}, "global_batch=True is not a whole number", "pass global_batch= as a whole number"),
    ({"global_batch": 8.0}, "global_batch=8.0 is not a whole number", "a whole number"),
    ({"global_batch": 8, "timeout_s": float("inf")}, "timeout_s=inf is not a finite number", "or leave it out"),
    ({"global_batch": 8, "epochs": float("nan")}, "epochs=nan is not a finite number", "a finite number (or None)"),
    ({"global_batch": 8, "precision": 16}, "precision=16 is not a string", "a string"),
])
def test_bad_top_level_values_name_the_keyword(kwargs, words, fix):
    with pytest.raises(UsageError) as e:
        Config(**kwargs)
    assert words in e.value.what and fix in e.value.fix


# Every group's own checks: (the group, its bad fields, what the error says, what the fix says)
GROUP_ERRORS = [
    (Checkpoints, {"every": -3}, "Checkpoints(every=-3, keep=3)", "use positive numbers"),
    (Checkpoints, {"keep": 0}, "Checkpoints(every=50, keep=0)", "use positive numbers"),
    (Checkpoints, {"every": "10"}, "Checkpoints(every='10') is not a whole number", "pass every= as a whole number"),
    (Checkpoints, {"resume": "maybe"}, "Checkpoints(resume='maybe')", "'auto', 'must', 'never'"),
    (Checkpoints, {"resume": "must"}, "Checkpoints(resume='must') without a dir", "Checkpoints(dir=..., resume='must')"),
    (Checkpoints, {"preempt_grace_s": 0}, "Checkpoints(preempt_grace_s=0)", "e.g. 30"),
    (Rebalancing, {"threshold": -0.1}, "Rebalancing(threshold=-0.1)", "a fraction >= 0"),
    (Rebalancing, {"enabled": "no"}, "Rebalancing(enabled='no') is not True or False", "True or False"),
    (Compression, {"method": "zip"}, "Compression(method='zip')", "'powersgd'"),
    (Compression, {"powersgd_rank": 0}, "Compression(powersgd_rank=0)", "from 1 to 1024"),
    (Memory, {"margin": 1.0}, "Memory(margin=1.0)", "a fraction in [0, 1)"),
    (Memory, {"max_micro_batch": 2.5}, "Memory(max_micro_batch=2.5) is not a whole number (or None)", "or None"),
    (Memory, {"max_micro_batch": 0}, "Memory(max_micro_batch=0)", "a positive cap"),
    (Memory, {"activation_checkpointing": "some"}, "Memory(activation_checkpointing='some')", "'plan', 'all'"),
    (Memory, {"blocks": "not a name"}, "Memory(blocks='not a name')", "Memory(blocks='Block')"),
    (Reporting, {"status_every": -1}, "Reporting(status_every=-1)", "0 for no status lines"),
    (Reporting, {"verbose": "no"}, "Reporting(verbose='no') is not True or False", "True or False"),
    (Emulation, {"cluster": " "}, "Emulation(cluster=' ') names no devices", "Emulation(cluster='a100-80g,rtx3090')"),
    (Emulation, {"sample_s": 0}, "Emulation(sample_s=0)", "e.g. 0.002"),
    (Emulation, {"micro_s": 0.01}, "Emulation(micro_s=0.01)", "together with sample_s"),  # no clock to add it to
    (Emulation, {"sample_s": 0.002, "micro_s": -1.0}, "Emulation(micro_s=-1.0)", "0 to 10"),
    (Emulation, {"link_gbs": 0}, "Emulation(link_gbs=0)", "Emulation(link_gbs=1.0)"),
]


@pytest.mark.parametrize("group, bad, words, fix", GROUP_ERRORS)
def test_every_group_checks_its_fields_and_names_the_fix(group, bad, words, fix):
    with pytest.raises(UsageError) as e:
        group(**bad)
    assert words in e.value.what and fix in e.value.fix
    name = next(n for n, g in GROUPS.items() if g is group)
    with pytest.raises(UsageError) as again:           # the same error when the group comes as a dict
        Config(global_batch=8, **{name: bad})
    assert again.value.what == e.value.what


def test_the_groups_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        Checkpoints("ckpt")                                     # type: ignore[misc]
    with pytest.raises(AttributeError):
        Checkpoints(dir="ckpt").dir = "other"                   # type: ignore[misc]


def test_numbers_of_either_kind_are_fine_where_a_float_is_asked():
    c = Config(global_batch=8, epochs=1, timeout_s=30, memory=Memory(margin=0))
    assert c.epochs == 1 and c.memory.margin == 0


def test_a_group_takes_a_dict_of_its_fields_and_only_those():
    c = Config(global_batch=8, checkpoints={"dir": "ck", "every": 5}, memory={"max_micro_batch": 4})
    assert c.checkpoints == Checkpoints(dir="ck", every=5) and c.memory == Memory(max_micro_batch=4)
    assert c.rebalancing == Rebalancing() and c.emulation == Emulation()          # the defaults
    with pytest.raises(UsageError) as e:
        Config(global_batch=8, checkpoints={"dri": "ck"})
    assert "Checkpoints has no field 'dri' (did you mean: dir?)" in e.value.what
    assert e.value.fix == "Checkpoints takes dir, every, keep, resume, preempt_grace_s"
    with pytest.raises(UsageError) as e:
        Config(global_batch=8, memory=0.2)
    assert "memory=0.2 is not a Memory (or a dict of its fields)" in e.value.what
    assert "from hetrain import Memory" in e.value.fix and "margin, max_micro_batch" in e.value.fix


def test_a_config_round_trips_through_a_dict_and_json():
    cfg = Config(global_batch=64, seed=3, precision="auto", max_steps=10,
                 memory=Memory(margin=0.2, max_micro_batch=8, activation_checkpointing="all", blocks="Block"),
                 checkpoints=Checkpoints(dir="ck", every=5, keep=2, resume="must", preempt_grace_s=10),
                 rebalancing=Rebalancing(enabled=False, threshold=0.1),
                 compression=Compression(method="powersgd", powersgd_rank=8),
                 reporting=Reporting(verbose=False, status_every=10, metrics_dir="m", sample_log="s"),
                 emulation=Emulation(cluster="a100-80g,rtx3090", sample_s=0.002, micro_s=0.001, link_gbs=1.0,
                                     faults="die:rank=1,step=5"))
    assert cfg.to_dict()["checkpoints"] == {"dir": "ck", "every": 5, "keep": 2, "resume": "must",
                                            "preempt_grace_s": 10}
    assert Config(**cfg.to_dict()) == cfg
    assert Config(**json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert make_config(cfg.to_dict()) == cfg          # `hetrain plan` reads its saved config this way


def test_the_groups_a_script_sets_are_exported_from_hetrain_and_emulation_is_not():
    for name in ("Checkpoints", "Rebalancing", "Compression", "Memory", "Reporting"):
        assert name in hetrain.__all__ and getattr(hetrain, name) is GROUPS[name.lower()]
    # the launcher's and the tests' group: reached through the emulator's package, never `hetrain.`
    from hetrain.emulation import Emulation

    assert "Emulation" not in hetrain.__all__ and "Emulation" not in vars(hetrain)
    assert Emulation is GROUPS["emulation"]


@pytest.mark.parametrize("keywords, place, fix", [
    ({"sharding": "fsdp"}, "it is DataParallel(sharding=...) in prepare(parallel=...)",
     "remove sharding= and pass ht.prepare(..., parallel=hetrain.DataParallel(sharding='fsdp'))"),
    ({"checkpoint_dir": "ck"}, "it is checkpoints=Checkpoints(dir=...) (or `hetrain run --checkpoint-dir`)",
     "remove checkpoint_dir= and pass checkpoints=hetrain.Checkpoints(dir='ck')"),
    ({"zero_stage": 3}, "ZeRO-3 'fsdp'", "parallel=hetrain.DataParallel(sharding="),
    ({"gradient_accumulation_steps": 4}, "global_batch=N", "remove gradient_accumulation_steps="),
    ({"bf16": True}, "precision=", "pass precision='bf16'"),
    ({"plan": "p.json"}, "init(plan=) for the job", "hetrain.init(plan=path_or_Plan)"),
])
def test_a_word_from_another_tool_names_where_the_setting_lives(keywords, place, fix):
    """Config(...) and make_config (init, the integrations) alike: one line, the setting's place."""
    for where, make in (("hetrain.Config", lambda: Config(global_batch=8, **keywords)),
                        ("HetrainStrategy", lambda: make_config({"global_batch": 8, **keywords}, where="HetrainStrategy"))):
        with pytest.raises(UsageError) as e:
            make()
        name = next(iter(keywords))
        assert e.value.what.startswith(f"{where}: {name}= is not a keyword of hetrain.Config; ") and \
            place in e.value.what and fix in e.value.fix, (e.value.what, e.value.fix)
        assert "\n" not in str(e.value)


def test_every_place_in_the_hint_table_is_a_real_setting():
    """Each fix passes a keyword Config takes (a group's field, where it names one), or a layout
    object prepare() takes, or init's plan: the table cannot point at a setting that is not there."""
    known = {f.name for f in fields(Config)}
    for name, (place, fix) in WHERE.items():
        assert name not in known, name                     # a hint never shadows a real keyword
        fix = fix.format(value="v")
        if fix.startswith(("ht.prepare(", "hetrain.init(plan=")):
            continue
        keyword = fix.split("=", 1)[0]
        assert keyword in known, (name, fix)
        if group := re.match(r"(\w+)=hetrain\.(\w+)\((\w+)=", fix):
            assert GROUPS[group[1]].__name__ == group[2] and group[3] in {f.name for f in fields(GROUPS[group[1]])}, fix


def test_an_unknown_keyword_gets_the_close_names_in_config_too():
    with pytest.raises(UsageError) as e:
        Config(global_batch=8, presicion="fp16")            # type: ignore[call-arg]
    assert e.value.what.startswith("hetrain.Config: unknown keyword 'presicion' (did you mean: precision")
    with pytest.raises(UsageError) as e:
        Config(global_batch=8, compression="fp16")          # type: ignore[arg-type]
    assert "compression='fp16' is not a Compression" in e.value.what and "Compression(...)" in e.value.fix
    assert "sharding" not in Config(global_batch=8).to_dict() and "plan" not in Config(global_batch=8).to_dict()


@pytest.fixture
def hook(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)     # init() installs its own: put it back after


@pytest.mark.parametrize("kwargs, words, fix", [
    ({"global_batch": 8, "bogus_keyword": 1}, "unknown keyword 'bogus_keyword'", "remove bogus_keyword="),
    ({"global_batch": 8, "checkpoint_evry": 5}, "did you mean: checkpoints", "remove checkpoint_evry="),
    ({"global_batch": 8, "presicion": "fp16"}, "did you mean: precision", "remove presicion="),
    ({"global_batch": 8, "checkpoint_dir": "x"}, "hetrain.init: checkpoint_dir= is not a keyword of hetrain.Config; "
     "it is checkpoints=Checkpoints(dir=...)", "pass checkpoints=hetrain.Checkpoints(dir='x')"),
    ({"checkpoint_dir": "x"}, "checkpoint_dir= is not a keyword", "Checkpoints(dir='x')"),   # before global_batch
    ({}, "no global_batch given", "global_batch=N"),
    ({"global_batch": 8, "plan": 3}, "plan=3 is neither a Plan nor a path", "hetrain plan --out"),
    ({"global_batch": 8, "sharding": "fsdp"}, "it is DataParallel(sharding=...) in prepare(parallel=...)",
     "parallel=hetrain.DataParallel(sharding='fsdp')"),
])
def test_init_refuses_what_config_does_not_know(hook, kwargs, words, fix):
    with pytest.raises(UsageError) as e:
        init(**kwargs)
    assert words in e.value.what and fix in e.value.fix


@pytest.mark.parametrize("content", [None, "{not json", '"a string"'])
def test_a_missing_or_broken_launch_file_is_one_usage_error(tmp_path, monkeypatch, content):
    path = tmp_path / "launch.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(LAUNCH_ENV, str(path))
    with pytest.raises(UsageError) as e:
        Config(global_batch=8).with_launch_file()
    assert "cannot read the launch file" in e.value.what and LAUNCH_ENV in e.value.fix


def _launch(tmp_path, monkeypatch, config: dict, defaults: dict | None = None):
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"config": config, "defaults": defaults or {}}))
    monkeypatch.setenv(LAUNCH_ENV, str(path))


def test_the_launch_file_is_validated_like_the_script(tmp_path, monkeypatch):
    _launch(tmp_path, monkeypatch, {"precision": "fp64"})
    with pytest.raises(UsageError, match="precision='fp64'"):
        Config(global_batch=8).with_launch_file()
    _launch(tmp_path, monkeypatch, {"emulation": {"sample_s": -1}})
    with pytest.raises(UsageError, match=r"Emulation\(sample_s=-1\)"):
        Config(global_batch=8).with_launch_file()


def test_the_command_line_beats_the_script_field_by_field_inside_a_group(tmp_path, monkeypatch):
    _launch(tmp_path, monkeypatch, {"checkpoints": {"dir": "cli-ck", "every": None},     # None: not given
                                    "emulation": {"cluster": "a100-80g,rtx3090", "faults": None},
                                    "reporting": {"status_every": 5}, "precision": "bf16", "seed": None})
    script = Config(global_batch=8, seed=4, checkpoints=Checkpoints(dir="script-ck", every=7, keep=1),
                    reporting=Reporting(verbose=False), emulation=Emulation(sample_s=0.002))
    cfg = script.with_launch_file()
    assert cfg.checkpoints == Checkpoints(dir="cli-ck", every=7, keep=1)      # the script's every and keep stay
    assert cfg.emulation == Emulation(cluster="a100-80g,rtx3090", sample_s=0.002)
    assert cfg.reporting == Reporting(verbose=False, status_every=5)
    assert (cfg.precision, cfg.seed, cfg.memory) == ("bf16", 4, Memory())


def test_the_launch_defaults_fill_only_what_the_script_left_unset(tmp_path, monkeypatch):
    defaults = {"checkpoints": {"dir": "run/checkpoints"}}
    _launch(tmp_path, monkeypatch, {}, defaults)
    assert Config(global_batch=8).with_launch_file().checkpoints.dir == "run/checkpoints"
    mine = Config(global_batch=8, checkpoints=Checkpoints(dir="mine", every=3))
    assert mine.with_launch_file().checkpoints == Checkpoints(dir="mine", every=3)
    _launch(tmp_path, monkeypatch, {"checkpoints": {"dir": "cli"}}, defaults)     # the command line beats both
    assert mine.with_launch_file().checkpoints.dir == "cli"


def test_without_a_launch_file_the_config_is_the_scripts(monkeypatch):
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    cfg = Config(global_batch=8, checkpoints=Checkpoints(dir="ck"))
    assert cfg.with_launch_file() is cfg
