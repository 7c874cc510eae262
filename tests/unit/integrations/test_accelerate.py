"""hetrain.integrations.accelerate in one process: stock's class with every attribute, its own
distribution engines one line naming the fix, and the evaluation split cuts each batch by the shares exactly."""

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
    ({"deepspeed_plugin": object()}, "Accelerator(deepspeed_plugin=...): hetrain distributes the model itself"),
    ({"fsdp_plugin": object()}, "Accelerator(fsdp_plugin=...)"),
    ({"megatron_lm_plugin": object()}, "Accelerator(megatron_lm_plugin=...)"),
    ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
])
def test_accelerates_own_distribution_engines_are_one_line_naming_the_fix(Accelerator, kwargs, said):
    with pytest.raises(UsageError) as e:
        Accelerator(**kwargs)
    assert said in e.value.what and e.value.fix and "\n" not in str(e.value)


def test_it_is_stocks_class_and_every_public_attribute_is_there(Accelerator):
    import accelerate
    from accelerate import DataLoaderConfiguration, DistributedType

    acc = Accelerator(mixed_precision="bf16", cpu=True, step_scheduler_with_optimizer=False,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=False, even_batches=False))
    assert isinstance(acc, accelerate.Accelerator) and acc.hetrain["precision"] == "bf16"
    for name in dir(accelerate.Accelerator):
        if not name.startswith("_"):
            try:
                getattr(acc, name)
            except UsageError as e:         # the old class refused Accelerate's other names this way
                raise AssertionError(f"accelerator.{name} refused: {e}") from None
            except (AttributeError, ValueError, RuntimeError, NotImplementedError):
                pass                        # as stock's own property raises it in this setting
    assert acc.distributed_type == DistributedType.NO and acc.num_processes == 1 and acc.is_main_process
    assert acc.mixed_precision in ("bf16", "no")   # what this host computes bf16 in (hetrain's precision)
    assert acc.even_batches is False and acc.step_scheduler_with_optimizer is False
    with acc.main_process_first():
        pass
    assert acc.split_between_processes([1, 2, 3]).__enter__() == [1, 2, 3]
    assert acc.reduce(torch.ones(2), "sum").tolist() == [1.0, 1.0]
    with pytest.raises(UsageError, match="before accelerator.prepare"):
        acc.backward(torch.zeros(()))
    assert acc.sync_gradients


def test_prepare_needs_the_model_its_optimizer_and_the_training_data_together(Accelerator):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(UsageError, match="1 model.s., 0 optimizer.s. and 0 dataloader"):
        Accelerator().prepare(model)


@pytest.mark.parametrize("loader, said", [
    (dict(batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8)), 2, False)),
     "batch_sampler"),
    (dict(batch_size=2, sampler=torch.utils.data.SubsetRandomSampler(range(4))), "SubsetRandomSampler"),
])
def test_training_loaders_hetrains_sampler_cannot_honour_are_refused(loader, said):
    from hetrain.integrations.accel.checks import check_training_loader

    with pytest.raises(UsageError, match=said):
        check_training_loader(torch.utils.data.DataLoader(list(range(8)), **loader))
    assert check_training_loader(torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True,
                                                             drop_last=True)) == (True, True)
    # a DataLoader's own workers are honoured (they become hetrain's Config.num_workers)
    assert check_training_loader(torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2)) == \
        (False, False)


def test_dispatch_batches_with_uneven_shares_is_one_line_naming_the_fix():
    from accelerate import DataLoaderConfiguration

    from hetrain.integrations.accel.checks import check_dispatch

    with pytest.raises(UsageError) as e:
        check_dispatch(DataLoaderConfiguration(dispatch_batches=True), (10, 6))
    assert "dispatch_batches=True" in e.value.what and "(10, 6)" in e.value.what
    assert "DataLoaderConfiguration(dispatch_batches=False)" in e.value.fix and "\n" not in str(e.value)
    check_dispatch(DataLoaderConfiguration(dispatch_batches=True), (8, 8))      # equal shares: as stock
    check_dispatch(DataLoaderConfiguration(), (10, 6))


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
