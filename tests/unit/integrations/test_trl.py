"""hetrain.integrations.trl without processes: which trainers and arguments are refused (one line
each, naming the fix), the loss weighting each trainer gets, and the gathers kept on their rank."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from hetrain.errors import UsageError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason='needs pip install "hetrain[hf]"')


@pytest.fixture(scope="module")
def trl_face():
    import hetrain.integrations.trl as face

    return face


@pytest.mark.parametrize("name, said", [
    ("GRPOTrainer", "makes its own batches"), ("RLOOTrainer", "makes its own batches"),
    ("DistillationTrainer", "makes its own batches"), ("KTOTrainer", "KL estimate"),
])
def test_trainers_that_cannot_run_under_hetrains_loop_are_refused_in_one_line(trl_face, name, said):
    import trl

    with pytest.raises(UsageError) as e:
        trl_face.hetrain_trainer(getattr(trl, name))
    assert said in e.value.what and "\n" not in str(e.value) and e.value.fix


def test_a_subclass_with_its_own_training_step_or_no_trainer_at_all_is_refused(trl_face):
    import trl

    class Mine(trl.SFTTrainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)

    with pytest.raises(UsageError, match="Mine overrides training_step"):
        trl_face.hetrain_trainer(Mine)
    with pytest.raises(UsageError, match="not a transformers.Trainer subclass"):
        trl_face.hetrain_trainer(dict)
    with pytest.raises(UsageError, match="hetrain's Trainer already"):
        trl_face.hetrain_trainer(trl_face.SFTTrainer)


def test_the_wrapped_classes_are_trls_own_with_hetrains_loop(trl_face):
    import trl

    from hetrain.integrations.transformers import Trainer

    for made, stock in ((trl_face.SFTTrainer, trl.SFTTrainer), (trl_face.DPOTrainer, trl.DPOTrainer)):
        assert issubclass(made, stock) and issubclass(made, Trainer) and made.__name__ == stock.__name__
        assert made.train is Trainer.train              # hetrain's loop, not TRL's
    reward = trl_face.hetrain_trainer(trl.RewardTrainer)   # a per-pair loss: allowed
    assert issubclass(reward, trl.RewardTrainer)


@pytest.mark.parametrize("args, said", [
    (SimpleNamespace(activation_offloading=True), "activation_offloading=True"),
    (SimpleNamespace(loss_type=["sigmoid", "aot"]), "loss_type='aot'"),
    (SimpleNamespace(loss_type="aot_unpaired"), "loss_type='aot_unpaired'"),
])
def test_arguments_hetrains_loop_would_not_honour_are_refused(args, said):
    from hetrain.integrations.trl_parts.trainers import refuse_arguments

    with pytest.raises(UsageError) as e:
        refuse_arguments("DPOTrainer", args)
    assert said in e.value.what and e.value.fix


def test_per_pair_losses_and_sft_arguments_pass():
    from hetrain.integrations.trl_parts.trainers import refuse_arguments

    refuse_arguments("DPOTrainer", SimpleNamespace(loss_type=["sigmoid", "sft"], activation_offloading=False))
    refuse_arguments("SFTTrainer", SimpleNamespace(loss_type="nll", activation_offloading=False))


def test_the_weighting_follows_what_the_stock_trainer_normalises_by():
    from hetrain.integrations.trl_parts.trainers import TrlLoop

    def judged(scaled, accepts, func=None):
        return TrlLoop.normalised_by_tokens(SimpleNamespace(loss_is_scaled_for_ga=scaled, model_accepts_loss_kwargs=accepts,
                                                            compute_loss_func=func))

    assert judged(None, True)                # SFT on a causal LM: num_items_in_batch, the global batch's tokens
    assert not judged(False, True)           # DPO, reward: a mean over the micro-batch's pairs
    assert not judged(None, False)           # a model without loss kwargs: a per-micro-batch mean
    assert judged(None, False, func=len)     # compute_loss_func gets num_items_in_batch


def test_gathers_inside_compute_loss_are_this_ranks_own_and_restored_after():
    from hetrain.integrations.trl_parts.metrics import local, rank_local_gathers

    class Accelerator:
        num_processes = 2

        def gather(self, x):
            raise AssertionError("a collective per micro-batch")

        gather_for_metrics = gather

    acc = Accelerator()
    with rank_local_gathers(acc):
        with rank_local_gathers(acc):          # nested: left as they are
            assert acc.gather_for_metrics(torch.tensor(3.0)).tolist() == [3.0]     # 0-d -> 1 element, as gather
        assert acc.gather(torch.ones(2, 3)).shape == (2, 3)
    assert "gather" not in vars(acc) and "gather_for_metrics" not in vars(acc)
    with pytest.raises(AssertionError, match="collective"):
        acc.gather(torch.ones(1))
    assert local({"a": [torch.tensor(1.0)], "b": 2}) == {"a": [torch.tensor([1.0])], "b": 2}


def test_without_trl_the_import_names_the_hf_extra():
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[3] / "src"
    code = ("import sys\nsys.modules['trl'] = None\nfrom hetrain.errors import UsageError\n"
            "try:\n    import hetrain.integrations.trl\nexcept UsageError as e:\n    print('FIX', e.fix)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.stdout.strip().splitlines()[-1] == 'FIX pip install "hetrain[hf]"', r.stdout + r.stderr
