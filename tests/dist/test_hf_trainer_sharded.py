"""hetrain's Trainer under each sharding, token-weighted (the Trainer's num_items_in_batch), against
the stock Trainer in one process on the same samples: the logged grad_norm and the final weights.

float64 GPT-2 (hf_tiny), SGD so a wrong gradient scale shows in the weights (Adam would hide a
constant factor), max_grad_norm small enough that clipping acts on every step (a wrong norm then
moves the weights too)."""

from __future__ import annotations

import importlib.util

import pytest

from harness import run_ranks
from hf_tiny import Tokens, gpt2

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason='needs pip install "hetrain[hf]"')]

N, STEPS = 64, 3


def mean_loss(outputs, labels, num_items_in_batch=None):
    """The mean over the tokens the loss predicts (labels[:, 1:]): a GPT-2 built from a config names no
    loss_type, so stock would count every label for num_items_in_batch (docs/integrations.md)."""
    import torch.nn.functional as F

    logits = outputs.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def arguments(out_dir, per_device, accum):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=0.1,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.5,
                             train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True)


def write_plan(path) -> str:
    from hetrain.planning.plan import DevicePlan, Plan

    devices = tuple(DevicePlan(rank=r, device="cpu", speed=1.0, share=s, micro_batch=m)
                    for r, (s, m) in enumerate(((10, 4), (6, 6))))
    path.write_text(Plan(global_batch=16, devices=devices).to_json())
    return str(path)


def worker(rank, world, out_dir, plan_path, sharding):
    from hetrain.integrations.transformers import Trainer

    trainer = Trainer(model=gpt2(), args=arguments(out_dir, 4, 2), train_dataset=Tokens(N), compute_loss_func=mean_loss,
                      hetrain={"plan": plan_path, "sharding": sharding, "loss_weighting": "tokens",
                               "rebalancing": {"enabled": False}, "reporting": {"verbose": False}})
    trainer.train()
    from torch.distributed.tensor import DTensor

    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for p in trainer.model.parameters()]
    return {"norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e], "params": params}


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    import transformers

    trainer = transformers.Trainer(model=gpt2(), args=arguments(str(tmp_path_factory.mktemp("stock")), 16, 1),
                                   train_dataset=Tokens(N), compute_loss_func=mean_loss)
    trainer.train()
    return {"norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
            "params": [p.detach().clone() for p in trainer.model.parameters()]}


FSDP_GAP = pytest.mark.xfail(strict=True, reason=(
    "known gap: under the Trainer, FSDP2's gradients differ from stock's by ~0.3% (every parameter, unevenly; "
    "the first grad_norm 1.1685 against 1.1644), while ht.prepare's own loop under FSDP2 gives stock's gradients "
    "exactly on the same model, plan and token weighting (docs/integrations.md)"))


@pytest.mark.parametrize("sharding", ["zero1", pytest.param("fsdp", marks=FSDP_GAP)])
def test_each_sharding_logs_stocks_grad_norm_and_reaches_its_weights(tmp_path, stock, sharding):
    runs = run_ranks(worker, 2, str(tmp_path / "h"), write_plan(tmp_path / "plan.json"), sharding, timeout=240)
    assert len(stock["norms"]) == STEPS and all(n > 0.5 for n in stock["norms"])     # clipping acts every step
    for r in runs:
        assert r["norms"] == pytest.approx(stock["norms"], rel=1e-9)
        assert max((a - b).abs().max().item() for a, b in zip(r["params"], stock["params"])) < 1e-10
