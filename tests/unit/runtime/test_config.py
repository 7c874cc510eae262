"""Config and init(): every bad keyword or value is a UsageError naming it and the fix, raised
before anything joins a process group."""

from __future__ import annotations

import json
import sys

import pytest

from hetrain.errors import UsageError
from hetrain.runtime.config import LAUNCH_ENV, Config
from hetrain.runtime.engine import init


@pytest.mark.parametrize("kwargs, words", [
    ({"global_batch": -1}, "global_batch=-1"),
    ({"global_batch": True}, "global_batch=True is not a whole number"),
    ({"global_batch": 8.0}, "global_batch=8.0 is not a whole number"),
    ({"global_batch": 8, "checkpoint_every": -3}, "checkpoint_every=-3"),
    ({"global_batch": 8, "checkpoint_every": "10"}, "checkpoint_every='10' is not a whole number"),
    ({"global_batch": 8, "micro_batch": 2.5}, "micro_batch=2.5 is not a whole number (or None)"),
    ({"global_batch": 8, "timeout_s": float("inf")}, "timeout_s=inf is not a finite number"),
    ({"global_batch": 8, "epochs": float("nan")}, "epochs=nan is not a finite number"),
    ({"global_batch": 8, "verbose": "no"}, "verbose='no' is not True or False"),
    ({"global_batch": 8, "precision": 16}, "precision=16 is not a string"),
    ({"global_batch": 8, "emulate": " "}, "emulate='' names no devices"),
    ({"global_batch": 8, "emulate_link_gbs": 0}, "emulate_link_gbs=0"),
    ({"global_batch": 8, "emulate_micro_s": 0.01}, "emulate_micro_s=0.01"),       # no clock to add it to
    ({"global_batch": 8, "emulate_sample_s": 0.002, "emulate_micro_s": -1.0}, "emulate_micro_s=-1.0"),
    ({"global_batch": 8, "compression": "zip"}, "compression='zip'"),
    ({"global_batch": 8, "powersgd_rank": 0}, "powersgd_rank=0"),
    ({"global_batch": 8, "compression": "fp16", "sharding": "fsdp"}, "compression='fp16' with sharding='fsdp'"),
])
def test_bad_values_name_the_keyword(kwargs, words):
    with pytest.raises(UsageError) as e:
        Config(**kwargs)
    assert words in e.value.what and e.value.fix


def test_numbers_of_either_kind_are_fine_where_a_float_is_asked():
    assert Config(global_batch=8, epochs=1, timeout_s=30, memory_margin=0).epochs == 1


@pytest.fixture
def hook(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)     # init() installs its own: put it back after


@pytest.mark.parametrize("kwargs, words, fix", [
    ({"global_batch": 8, "bogus_keyword": 1}, "unknown keyword 'bogus_keyword'", "remove bogus_keyword="),
    ({"global_batch": 8, "checkpoint_evry": 5}, "did you mean: checkpoint_every,", "remove checkpoint_evry="),
    ({}, "no global_batch given", "global_batch=N"),
    ({"global_batch": 8, "plan": 3}, "plan=3 is neither a Plan nor a path", "hetrain plan --out"),
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


def test_the_launch_file_is_validated_like_the_script(tmp_path, monkeypatch):
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"config": {"precision": "fp64"}, "defaults": {}}))
    monkeypatch.setenv(LAUNCH_ENV, str(path))
    with pytest.raises(UsageError, match="precision='fp64'"):
        Config(global_batch=8).with_launch_file()
