"""TrainingArguments read as hetrain's job (hetrain.integrations.hf.arguments): the global batch rule,
what maps to what, and every conflicting argument refused with its fix."""

from __future__ import annotations

import importlib.util

import pytest

from hetrain import Checkpoints, Config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason='needs pip install "hetrain[hf]"')


def args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)


def test_the_global_batch_is_the_stock_trainers_on_as_many_equal_devices(tmp_path):
    from hetrain.integrations.transformers import global_batch

    a = args(tmp_path, per_device_train_batch_size=6, gradient_accumulation_steps=4)
    assert global_batch(a, 1, {}) == 24
    assert global_batch(a, 3, {}) == 72
    assert global_batch(a, 3, {"global_batch": 72}) == 72     # said twice, the same: accepted


def test_a_global_batch_that_disagrees_with_the_arguments_names_both_and_the_fix(tmp_path):
    from hetrain.errors import UsageError
    from hetrain.integrations.transformers import global_batch

    a = args(tmp_path, per_device_train_batch_size=6, gradient_accumulation_steps=4)
    with pytest.raises(UsageError) as e:
        global_batch(a, 2, {"global_batch": 64})
    assert "per_device_train_batch_size 6 x gradient_accumulation_steps 4 x 2 device(s) = 48" in e.value.what
    assert "e.g. per_device_train_batch_size=32, gradient_accumulation_steps=1" in e.value.fix


def test_the_arguments_that_map(tmp_path):
    from hetrain.integrations.hf.arguments import KEEP_ALL
    from hetrain.integrations.transformers import job_config

    a = args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=30, bf16=True,
             max_grad_norm=0.5, seed=7, dataloader_drop_last=True, train_sampling_strategy="sequential",
             save_steps=10, save_total_limit=2, activation_checkpointing=True, dataloader_num_workers=3)
    c = job_config(a, world_size=2, dataset_len=100, hetrain={"emulation": {"cluster": "a100-80g,rtx3090"},
                                                              "checkpoints": Checkpoints(preempt_grace_s=60)})
    assert c == {"global_batch": 16, "seed": 7, "drop_last": True, "shuffle": False, "grad_clip": 0.5,
                 "precision": "bf16", "num_workers": 3, "max_steps": 30, "memory": {"activation_checkpointing": "all"},
                 # a group given merges field by field with what the arguments decided
                 # every step's state kept: the Trainer's rotation (save_total_limit) removes it with its checkpoint-N
                 "checkpoints": {"dir": str(tmp_path / "hetrain"), "every": 10, "keep": KEEP_ALL, "preempt_grace_s": 60},
                 "emulation": {"cluster": "a100-80g,rtx3090"}}
    assert Config(**c).checkpoints == Checkpoints(dir=str(tmp_path / "hetrain"), every=10, keep=KEEP_ALL,
                                                  preempt_grace_s=60)
    e = job_config(args(tmp_path, num_train_epochs=2, save_strategy="epoch", data_seed=3, max_grad_norm=0.0),
                   world_size=1, dataset_len=20, hetrain={})
    # 20 samples at a global batch of 8: three steps an epoch (the last one straddles, as nothing is dropped)
    assert (e["epochs"], e["checkpoints"]["every"], e["seed"], e["grad_clip"], e["precision"]) == (2.0, 3, 3, None, "fp32")
    assert "checkpoints" not in job_config(args(tmp_path, save_strategy="no"), world_size=1, dataset_len=8,
                                              hetrain={})


@pytest.mark.parametrize("given, said, fix", [
    ({"auto_find_batch_size": True}, "auto_find_batch_size=True", "remove auto_find_batch_size"),
    ({"train_sampling_strategy": "group_by_length"}, "'group_by_length'", "train_sampling_strategy='random'"),
    ({"save_strategy": "best", "eval_strategy": "steps", "metric_for_best_model": "loss"}, "save_strategy='best'",
     "load_best_model_at_end=True"),
    ({"batch_eval_metrics": True}, "batch_eval_metrics=True", "remove batch_eval_metrics"),
    ({"torch_compile": True}, "torch_compile=True", "remove torch_compile"),
])
def test_every_argument_hetrain_cannot_honour_is_refused_with_the_fix(tmp_path, given, said, fix):
    from hetrain.errors import UsageError
    from hetrain.integrations.hf.arguments import conflicts

    with pytest.raises(UsageError) as e:
        conflicts(args(tmp_path, **given), model_init=None)
    assert said in e.value.what and fix in e.value.fix
    # one line: the flag, why, the fix; no parenthesis left open or closed across the sentence
    for text in (e.value.what, e.value.fix):
        assert "\n" not in text and text.count("(") == text.count(")") and not text.endswith(")")


def test_what_hetrain_now_honours_is_not_refused(tmp_path):
    from hetrain.integrations.hf.arguments import conflicts

    conflicts(args(tmp_path, dataloader_num_workers=2, eval_strategy="steps", eval_steps=5,
                   load_best_model_at_end=True, save_steps=5, metric_for_best_model="eval_loss"), model_init=None)


def test_hetrain_keys_the_arguments_decide_are_refused(tmp_path):
    from hetrain.errors import UsageError
    from hetrain.integrations.transformers import job_config

    with pytest.raises(UsageError) as e:
        job_config(args(tmp_path), world_size=1, dataset_len=8, hetrain={"max_steps": 5})
    assert "TrainingArguments decides it" in e.value.what and "set max_steps / num_train_epochs" in e.value.fix
    with pytest.raises(UsageError) as e:
        job_config(args(tmp_path), world_size=1, dataset_len=8, hetrain={"precison": "auto"})
    assert "did you mean: precision" in e.value.what


@pytest.mark.parametrize("given, said, fix", [
    ({"checkpoints": {"every": 5}}, "sets checkpoints.every; TrainingArguments decides it", "set save_steps"),
    ({"checkpoints": Checkpoints(keep=1)}, "sets checkpoints.keep", "set save_total_limit"),
    ({"checkpoints": {"dir": "x"}}, "sets checkpoints.dir", "set output_dir"),
    ({"micro_batch": 4}, "micro_batch= is not a keyword of hetrain.Config; it is global_batch=N", "remove micro_batch="),
    ({"memory": {"margn": 0.2}}, "Memory has no field 'margn' (did you mean: margin?)", "Memory takes margin"),
])
def test_hetrain_groups_and_other_tools_words_in_the_trainer(tmp_path, given, said, fix):
    from hetrain.errors import UsageError
    from hetrain.integrations.transformers import job_config

    with pytest.raises(UsageError) as e:
        Config(**job_config(args(tmp_path), world_size=1, dataset_len=8, hetrain=given))
    assert said in e.value.what and fix in e.value.fix


def test_an_integrations_sharding_is_the_data_parallel_layout_it_runs(tmp_path):
    """hetrain={'sharding': ...} (HF, TRL, Fabric, Accelerate) maps to DataParallel(sharding=...),
    the one home of a sharding; init's plan passes through to init(plan=)."""
    from hetrain import DataParallel
    from hetrain.errors import UsageError
    from hetrain.integrations.transformers import job_config
    from hetrain.runtime.config import integration_layout

    c = job_config(args(tmp_path, save_strategy="no"), world_size=1, dataset_len=8,
                   hetrain={"sharding": "zero1", "plan": "plan.json"})
    rest, layout = integration_layout(c)
    assert layout == DataParallel(sharding="zero1") and "sharding" not in rest and rest["plan"] == "plan.json"
    assert integration_layout({"global_batch": 8}) == ({"global_batch": 8}, DataParallel())
    with pytest.raises(UsageError, match="not a sharding"):
        integration_layout({"sharding": "zero3"})
