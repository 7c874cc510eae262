"""The Trainer's fp16 and bf16 under hetrain, against the stock Trainer in one process: fp16 with
the Trainer's default fused AdamW trains as the unfused one does (it crashed in the job-wide loss
scaler, then applied inf gradients on a step every rank skipped), a skipped step leaves the learning
rate where it was (stock's rule), and bf16 logs what stock logs; dataloader_num_workers is accepted.

On a CPU, stock's fp16=True does not autocast (its losses are fp32's to 1e-7), while hetrain's fp16
computes in fp16, so fp16 is held to stock on the forward before any step only.
"""

from __future__ import annotations

import importlib.util

import pytest

from harness import free_port, run_ranks
from hf_tiny import Tokens, gpt2

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason='needs pip install "hetrain[hf]"')]

N, STEPS = 80, 4


def loss32(outputs, labels, num_items_in_batch=None):     # the mean over the counted tokens, as the model's
    import torch.nn.functional as F

    logits = outputs.logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def arguments(out_dir, per_device, accum, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="linear", warmup_steps=1, train_sampling_strategy="sequential",
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, **kw)


def write_plan(path) -> str:
    # A written plan: measured shares move with the host's load, and with them the micro-batches on
    # which fp16 overflows, so two runs planned apart could skip different steps.
    from hetrain.planning.plan import DevicePlan, Plan

    devices = tuple(DevicePlan(rank=r, device="cpu", speed=1.0, share=s, micro_batch=m)
                    for r, (s, m) in enumerate(((10, 4), (6, 6))))
    path.write_text(Plan(global_batch=16, devices=devices).to_json())
    return str(path)


def worker(rank, world, out_dir, plan_path, runs, ports):
    """Each of `runs` ({name: TrainingArguments' extra keywords}) in turn, in this one set of
    processes, each on a port of its own (a run's data workers, forked from rank 0, hold its
    store's listening socket until they exit)."""
    import os

    out = {}
    for (name, kw), port in zip(runs.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        out[name] = train(f"{out_dir}/{name}", plan_path, kw)
    return out


def train(out_dir, plan_path, kw):
    from hetrain.integrations.transformers import Trainer

    trainer = Trainer(model=gpt2().float(), args=arguments(out_dir, 4, 2, **kw), train_dataset=Tokens(N),
                      compute_loss_func=loss32, hetrain={"plan": plan_path, "loss_weighting": "tokens",
                                                         "rebalancing": {"enabled": False},
                                                         "reporting": {"verbose": False}})
    trainer.train()
    return {"log": [e for e in trainer.state.log_history if "loss" in e], "summary": trainer.hetrain_summary,
            "params": [p.detach().clone() for p in trainer.model.parameters()]}


def stock(out_dir, **kw):
    import transformers

    trainer = transformers.Trainer(model=gpt2().float(), args=arguments(out_dir, 16, 1, **kw), train_dataset=Tokens(N),
                                   compute_loss_func=loss32)
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp16 with the fused AdamW (and data workers), fp16 with the unfused one, and bf16: one
    process group, one run after another, on one written plan."""
    tmp = tmp_path_factory.mktemp("hf_precision")
    results = run_ranks(worker, 2, str(tmp), write_plan(tmp / "plan.json"),
                        {"fused": {"fp16": True, "optim": "adamw_torch_fused", "dataloader_num_workers": 2},
                         "plain": {"fp16": True, "optim": "adamw_torch"}, "bf16": {"bf16": True}},
                        [free_port() for _ in range(3)], timeout=400)
    return {name: [r[name] for r in results] for name in results[0]}


def test_fp16_with_the_default_fused_adamw_trains_as_the_unfused_one(runs, tmp_path):
    fused, plain = runs["fused"], runs["plain"]
    reference = stock(str(tmp_path / "s"), fp16=True)
    for f, p in zip(fused, plain):
        assert f["summary"]["precision"]["precision"] == "fp16"
        skipped = f["summary"]["precision"]["skipped_at"]
        assert skipped == p["summary"]["precision"]["skipped_at"]     # agreed by both ranks, in both runs
        losses = [e["loss"] for e in f["log"]]
        assert all(x == x for x in losses)                           # no inf gradient was ever applied
        assert losses == pytest.approx([e["loss"] for e in p["log"]], rel=1e-5)
        # fused and foreach AdamW round apart; Adam's step is ~lr whatever the gradient's size, so a
        # rounding apart moves a weight by a small part of lr (2.5e-4 measured), a step applied on one
        # side only by about lr (1e-2)
        assert max((a - b).abs().max().item() for a, b in zip(f["params"], p["params"])) < 1e-3
        # the learning rate moves only on the steps that stepped (stock skips the scheduler too)
        lrs = [e["learning_rate"] for e in f["log"]]
        assert lrs[:len(skipped) + 1] == [0.0] * (len(skipped) + 1) and lrs[len(skipped) + 1] == 1e-2
    assert fused[0]["log"][0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-3)   # fp16's forward


def test_bf16_logs_what_the_stock_trainer_logs(runs, tmp_path):
    reference = stock(str(tmp_path / "s"), bf16=True)
    for r in runs["bf16"]:
        assert r["summary"]["precision"]["precision"] == "bf16"
        assert [e["step"] for e in r["log"]] == [e["step"] for e in reference]
        assert [e["learning_rate"] for e in r["log"]] == pytest.approx([e["learning_rate"] for e in reference])
        assert [e["loss"] for e in r["log"]] == pytest.approx([e["loss"] for e in reference], rel=1e-3)
        assert [e["grad_norm"] for e in r["log"]] == pytest.approx([e["grad_norm"] for e in reference], rel=1e-2)
