"""hetrain.integrations.accelerate without processes: Accelerate's features outside the wrapped set
are one line naming the fix, and the evaluation split cuts each batch by the shares exactly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hetrain.errors import UsageError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason='needs pip install "hetrain[hf]"')


@pytest.fixture(scope="module")
def Accelerator():
    from hetrain.integrations.accelerate import Accelerator

    return Accelerator


@pytest.mark.parametrize("kwargs, said", [
    ({"deepspeed_plugin": object()}, "Accelerator(deepspeed_plugin=...): not part of hetrain's Accelerator"),
    ({"fsdp_plugin": object()}, "Accelerator(fsdp_plugin=...)"),
    ({"megatron_lm_plugin": object()}, "Accelerator(megatron_lm_plugin=...)"),
    ({"kwargs_handlers": []}, "Accelerator(kwargs_handlers=...)"),
    ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
    ({"log_with": "wandb"}, "log_with='wandb'"),
    ({"step_scheduler_with_optimizer": False}, "step_scheduler_with_optimizer=False"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
])
def test_accelerate_features_outside_the_wrapped_set_are_one_line_naming_the_fix(Accelerator, kwargs, said):
    with pytest.raises(UsageError) as e:
        Accelerator(**kwargs)
    assert said in e.value.what and e.value.fix and "\n" not in str(e.value)


def test_accelerates_other_verbs_are_refused_and_unknown_names_stay_attribute_errors(Accelerator):
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    assert acc.hetrain["precision"] == "bf16"
    for verb in ("init_trackers", "log", "prepare_model", "reduce"):
        with pytest.raises(UsageError, match=f"accelerator.{verb}: not part of hetrain's Accelerator"):
            getattr(acc, verb)
    with pytest.raises(AttributeError):
        assert acc.surely_not_an_accelerate_verb is None
    with pytest.raises(UsageError, match="load_state already continues"):
        acc.skip_first_batches(None, 3)
    with pytest.raises(UsageError, match="before accelerator.prepare"):
        acc.backward(torch.zeros(()))
    assert acc.is_main_process and acc.num_processes == 1 and acc.sync_gradients


def test_prepare_needs_the_model_its_optimizer_and_the_training_data_together(Accelerator):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(UsageError, match="1 model.s., 0 optimizer.s. and 0 dataloader"):
        Accelerator().prepare(model)


@pytest.mark.parametrize("loader, said", [
    (dict(batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8)), 2, False)),
     "batch_sampler"),
    (dict(batch_size=2, sampler=torch.utils.data.SubsetRandomSampler(range(4))), "SubsetRandomSampler"),
    (dict(batch_size=2, num_workers=2), "num_workers=2"),
])
def test_training_loaders_hetrains_sampler_cannot_honour_are_refused(loader, said):
    from hetrain.integrations.accel.accelerator import check_training_loader

    with pytest.raises(UsageError, match=said):
        check_training_loader(torch.utils.data.DataLoader(list(range(8)), **loader))
    assert check_training_loader(torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True,
                                                             drop_last=True)) == (True, True)


def test_an_evaluation_batch_is_cut_by_the_shares_and_sums_exactly():
    from hetrain.integrations.accel.evaluation import split

    assert split(10, (10, 6)) == [6, 4]
    assert split(1, (10, 6)) == [1, 0]
    for total in range(0, 40):
        sizes = split(total, (39, 25, 3))
        assert sum(sizes) == total and all(abs(s - total * w / 67) < 1 for s, w in zip(sizes, (39, 25, 3)))


def test_without_accelerate_the_import_names_the_hf_extra():
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[3] / "src"
    code = ("import sys\nsys.modules['accelerate'] = None\nfrom hetrain.errors import UsageError\n"
            "try:\n    import hetrain.integrations.accelerate\nexcept UsageError as e:\n    print('FIX', e.fix)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.stdout.strip().splitlines()[-1] == 'FIX pip install "hetrain[hf]"', r.stdout + r.stderr
