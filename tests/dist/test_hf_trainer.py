"""The Hugging Face Trainer on hetrain (hetrain.integrations.transformers): a stock Trainer script
with one changed import trains a tiny GPT-2 on two emulated ranks with uneven shares, through an
out-of-memory error, and equals one plain process training on the concatenated big batch; a run
stopped by a callback on one rank stops on both, and resumes from its Trainer checkpoint to the
same parameters as the run that never stopped.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hf_tiny import gpt2, token_data as tokens_of
from hf_tiny import Tokens as TokensOf
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason='needs pip install "hetrain[hf]"')]

N, STEPS = 80, 4
PER_DEVICE, ACCUM = 4, 2                # the Trainer's global batch: 4 x 2 x 2 devices = 16 samples a step
SHARES, MICROS = (10, 6), (4, 6)        # hetrain's uneven split of it: rank 0 runs 4, 4, 2; rank 1 one of 6
FAULTS = "oom:rank=1,step=1,micro=0,phase=forward"    # rank 1's micro-batch 6 -> 3, redone
CLUSTER = "a100-80g,rtx3090:1.0"        # the plan is given: at speed 1 no emulated device sleeps


def write_plan(path) -> str:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (1.0, 0.67), SHARES, MICROS)))
    path.write_text(Plan(global_batch=sum(SHARES), devices=devices).to_json())
    return str(path)


def token_data():
    return tokens_of(N)


class Tokens(TokensOf):
    def __init__(self):
        super().__init__(N)


def lm_loss(logits, labels):
    """The causal LM's mean loss over the counted tokens, in float64 (transformers' own loss casts the
    logits to float32, whose rounding would hide a 1e-7 difference in the weighting)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def float64_loss(outputs, labels, num_items_in_batch=None):     # Trainer(compute_loss_func=...)
    return lm_loss(outputs.logits, labels)


def arguments(out_dir, **kw):
    from transformers import TrainingArguments

    given = dict(output_dir=out_dir, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=ACCUM,
                 max_steps=STEPS, learning_rate=1e-2, optim="adamw_torch", lr_scheduler_type="linear",
                 weight_decay=0.0, max_grad_norm=1.0, train_sampling_strategy="sequential", save_strategy="steps",
                 save_steps=2, logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**given, **kw})


def worker(rank, world, out_dir, plan_path, stop_at=None, resume=None, faults=None, args_kw=None):
    from transformers import TrainerCallback

    from hetrain.integrations.transformers import Trainer

    class StopOnOneRank(TrainerCallback):     # an early stop only rank 1 asks for: both ranks must stop
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == stop_at:
                control.should_training_stop = True

    trainer = Trainer(model=gpt2(), args=arguments(out_dir, **(args_kw or {})), train_dataset=Tokens(),
                      compute_loss_func=float64_loss,
                      callbacks=[StopOnOneRank()] if stop_at else None,
                      hetrain={"plan": plan_path, "loss_weighting": "tokens", "rebalancing": {"enabled": False},
                               "reporting": {"verbose": False},
                               "emulation": {"cluster": CLUSTER, "faults": faults}})
    result = trainer.train(resume_from_checkpoint=resume)
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "global_step": result.global_step,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "plan": trainer.hetrain_plan, "lr": [e["learning_rate"] for e in trainer.state.log_history
                                                  if "learning_rate" in e]}


def reference(steps: int = STEPS):
    """One process, no hetrain, no Trainer: AdamW on the mean loss over every counted token of each
    step's 16 samples (the sampler is sequential: step s is samples 16s..16s+15), clipped to norm 1,
    the learning rate decaying linearly to 0 over STEPS steps."""
    x, y = token_data()
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (STEPS - s) / STEPS))
    losses = []
    for s in range(steps):
        idx = torch.arange(16 * s, 16 * s + 16)
        loss = lm_loss(model(input_ids=x[idx]).logits, y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, [p.detach() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def first_worker(rank, world, root, plan_path):
    """The runs that start afresh, one after the other in one process group: the whole run (with an
    OOM), one stopped at step 2, a rerun into a copy of the whole run's output_dir, the three
    evaluation schedules and save_total_limit=2."""
    import shutil

    import torch.distributed as dist

    from pipeline_runs import join_group

    join_group()
    out = {"whole": worker(rank, world, f"{root}/whole/out", plan_path, None, None, FAULTS)}
    if rank == 0:
        shutil.copytree(f"{root}/whole/out", f"{root}/rerun/out")
    dist.barrier()
    out["stopped"] = worker(rank, world, f"{root}/stop/out", plan_path, 2, None, None)
    out["again"] = worker(rank, world, f"{root}/rerun/out", plan_path, None, None, None)
    for schedule in sorted(SCHEDULES):
        out[schedule] = parity_worker(rank, world, f"{root}/{schedule}/het", plan_path, SCHEDULES[schedule][0])
    out["limit 2"] = worker(rank, world, f"{root}/limit2/out", plan_path, None, None, None,
                            {"save_steps": 1, "save_total_limit": 2})
    return out


def resume_worker(rank, world, root, plan_path):
    """The resumes, in processes of their own as after a restart: the stopped run, and the rerun's
    older kept checkpoint into another output_dir."""
    from pipeline_runs import join_group

    join_group()
    return {"stopped": worker(rank, world, f"{root}/stop/out", plan_path, None, True, None),
            "kept": worker(rank, world, f"{root}/rerun/other", plan_path, None, f"{root}/rerun/out/checkpoint-2", None)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every Trainer run of this file: {"root", and each run's name: [rank 0's, rank 1's]}; the
    resumes under ("resumed", name)."""
    root = tmp_path_factory.mktemp("trainer")
    plan = write_plan(root / "plan.json")
    first = run_ranks(first_worker, 2, str(root), plan, timeout=600)
    out = {name: [r[name] for r in first] for name in first[0]}
    resumed = run_ranks(resume_worker, 2, str(root), plan, timeout=300)
    out.update({("resumed", name): [r[name] for r in resumed] for name in resumed[0]})
    return {"root": root, **out}


@pytest.fixture(scope="module")
def whole(runs):
    return runs["root"] / "whole", runs["whole"]


def test_a_stock_trainer_with_one_changed_import_equals_the_big_batch_on_uneven_shares(whole):
    _, runs = whole
    ref_losses, ref_params = reference()
    for r in runs:
        assert r["global_step"] == STEPS
        assert max_diff(r["params"], ref_params) <= 1e-9
        # the Trainer's log: the global loss, rounded by stock's float32 accumulator as stock logs it
        assert r["losses"] == [torch.tensor(x, dtype=torch.float32).item() for x in ref_losses]
        assert r["lr"] == pytest.approx([1e-2 * (STEPS - s) / STEPS for s in range(STEPS)])   # the rate each step used, as stock logs it
        plan = r["plan"]
        assert [d.share for d in plan.devices] == list(SHARES)
        assert [d.micro_batch for d in plan.devices] == [4, 3]             # rank 1's OOM halved its 6
    # The tolerance can see a wrong weighting: one process on rank 0's 10 samples alone differs.
    x, y = token_data()
    model = gpt2()
    lm_loss(model(input_ids=x[:10]).logits, y[:10]).backward()
    one = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lm_loss(model(input_ids=x[:16]).logits, y[:16]).backward()
    assert max_diff(one, [p.grad for p in model.parameters()]) > 1e-4


def test_the_checkpoints_keep_the_trainers_layout(whole):
    from transformers import GPT2LMHeadModel

    d, runs = whole
    out = d / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    last = out / "checkpoint-4"
    assert {"config.json", "model.safetensors", "trainer_state.json", "hetrain.json"} <= {p.name for p in last.iterdir()}
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == 4
    assert (out / "hetrain" / "step-00000004").is_dir()
    loaded = GPT2LMHeadModel.from_pretrained(last).double()
    assert max_diff(list(loaded.parameters()), runs[0]["params"]) == 0.0


def test_a_stop_asked_by_one_rank_stops_both_and_resumes_from_the_trainer_checkpoint_exactly(runs):
    stopped, resumed = runs["stopped"], runs["resumed", "stopped"]
    assert [r["global_step"] for r in stopped] == [2, 2]
    for r, w in zip(resumed, runs["whole"]):
        assert r["global_step"] == STEPS
        assert max_diff(r["params"], w["params"]) <= 1e-12       # as if it had never stopped
        assert r["losses"] == pytest.approx(w["losses"], abs=1e-12)   # the log history continues from checkpoint-2


# -- parity with the stock Trainer in one process, on the same data -----------------------------------
EVAL_N, EVAL_BATCH = 21, 4      # 6 evaluation batches, the last of 1: split 4/2 by the shares 10/6


def accuracy(pred):             # Trainer(compute_metrics=...): next-token accuracy over the counted labels
    logits, labels = pred.predictions, pred.label_ids
    hit = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & (labels[:, 1:] != -100)
    return {"accuracy": float(hit.sum() / (labels[:, 1:] != -100).sum())}


def parity_arguments(out_dir, per_device, accum, **kw):
    from transformers import TrainingArguments

    given = dict(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
                 max_steps=6, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.0,
                 max_grad_norm=1.0, train_sampling_strategy="sequential", logging_steps=2, eval_strategy="steps",
                 eval_steps=3, save_steps=3, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                 per_device_eval_batch_size=EVAL_BATCH, report_to="none", use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**given, **kw})


class Seen:                     # what a callback is given, as stock gives it
    def __init__(self):
        from transformers import TrainerCallback

        class Record(TrainerCallback):
            def on_step_end(inner, args, state, control, **kwargs):
                self.kwargs = sorted(k for k, v in kwargs.items() if v is not None)
        self.callback, self.kwargs = Record(), None


def stock_run(out_dir, **kw):
    """The stock transformers.Trainer, one process, the whole global batch of 16 a step."""
    import transformers

    seen = Seen()
    trainer = transformers.Trainer(model=gpt2(), args=parity_arguments(out_dir, 16, 1, **kw), train_dataset=Tokens(),
                                   eval_dataset=TokensOf(EVAL_N), compute_loss_func=float64_loss,
                                   compute_metrics=accuracy, callbacks=[seen.callback])
    trainer.train()
    return trainer, seen.kwargs


def parity_worker(rank, world, out_dir, plan_path, kw):
    from hetrain.integrations.transformers import Trainer

    seen = Seen()
    trainer = Trainer(model=gpt2(), args=parity_arguments(out_dir, 4, 2, **kw), train_dataset=Tokens(),
                      eval_dataset=TokensOf(EVAL_N), compute_loss_func=float64_loss, compute_metrics=accuracy,
                      callbacks=[seen.callback],
                      hetrain={"plan": plan_path, "loss_weighting": "tokens", "rebalancing": {"enabled": False},
                               "reporting": {"verbose": False}, "emulation": {"cluster": CLUSTER}})
    trainer.train()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "log": trainer.state.log_history,
            "best": trainer.state.best_model_checkpoint, "batch": trainer.state.train_batch_size,
            "callback": seen.kwargs}


TIMED = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def comparable(log):
    return [{k: v for k, v in entry.items() if k not in TIMED and not k.endswith(("_runtime", "_per_second"))}
            for entry in log]


# each evaluation and checkpoint schedule: every 3 steps (and before the first), or at each epoch's end (5 steps of 16 of
# the 80 samples) and the run's
SCHEDULES = {"steps": ({"eval_on_start": True}, ["checkpoint-3", "checkpoint-6"]),
             "epoch": ({"eval_strategy": "epoch", "save_strategy": "epoch"}, ["checkpoint-5", "checkpoint-6"]),
             # stock's save_total_limit=1 with load_best_model_at_end: the best one alone at the end
             "limit": ({"save_total_limit": 1, "eval_steps": 2, "save_steps": 2}, None)}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_the_trainer_logs_evaluates_and_keeps_the_best_model_as_stock_does(runs, tmp_path, schedule):
    kw, kept = SCHEDULES[schedule]
    stock, stock_seen = stock_run(str(tmp_path / "stock"), **kw)
    het_dir = runs["root"] / schedule / "het"
    want = comparable(stock.state.log_history)
    assert ["epoch", "grad_norm", "learning_rate", "loss", "step"] in [sorted(e) for e in want]
    assert ["epoch", "eval_accuracy", "eval_loss", "step"] in [sorted(e) for e in want]
    for r in runs[schedule]:
        got = comparable(r["log"])
        assert [sorted(e) for e in got] == [sorted(e) for e in want]
        for g, w in zip(got, want):       # loss (the mean of the steps since the last log), grad_norm, lr, flos
            assert g == pytest.approx(w, rel=1e-9, abs=1e-12), (g, w)
        assert r["best"].rsplit("/", 1)[1] == stock.state.best_model_checkpoint.rsplit("/", 1)[1]
        assert max_diff(r["params"], list(stock.model.parameters())) <= 1e-9     # the best model, loaded at the end
        assert r["batch"] == 4 and r["callback"] == stock_seen
    # save_total_limit=None keeps every checkpoint, as stock
    het = sorted(p.name for p in het_dir.glob("checkpoint-*"))
    assert het == sorted(p.name for p in (tmp_path / "stock").glob("checkpoint-*"))
    assert het == (kept or [stock.state.best_model_checkpoint.rsplit("/", 1)[1]])
    named = {json.loads((het_dir / c / "hetrain.json").read_text())["hetrain_state"] for c in het}
    assert {str(p.relative_to(het_dir)) for p in het_dir.glob("hetrain*/step-*")} == named


# -- checkpoints as stock keeps them ------------------------------------------------------------------
def pointers(out):
    return {p.name: json.loads((p / "hetrain.json").read_text())["hetrain_state"] for p in sorted(out.glob("checkpoint-*"))}


def test_a_rerun_into_the_same_output_dir_starts_afresh_and_any_kept_checkpoint_resumes_exactly(runs):
    out = runs["root"] / "rerun" / "out"          # a copy of the whole run's, rerun into
    # A second run into an output_dir that holds checkpoints trains afresh, as stock does (no
    # refusal), replacing each checkpoint-N as it reaches N; the old run's hetrain state goes with it.
    again, whole = runs["again"], runs["whole"]
    assert max_diff(again[0]["params"], whole[0]["params"]) <= 1e-12
    assert pointers(out) == {"checkpoint-2": "hetrain-1/step-00000002", "checkpoint-4": "hetrain-1/step-00000004"}
    assert not list((out / "hetrain").glob("step-*"))
    # An older kept checkpoint (checkpoint-4 is newer), resumed into another output_dir: exact.
    other = runs["root"] / "rerun" / "other"
    for r, w in zip(runs["resumed", "kept"], whole):
        assert r["global_step"] == STEPS and max_diff(r["params"], w["params"]) <= 1e-12
        assert r["losses"] == pytest.approx(w["losses"], abs=1e-12)    # the history of checkpoint-2, continued
    assert pointers(other) == {"checkpoint-4": "hetrain/step-00000004"}
    assert (other / "hetrain" / "step-00000002").is_dir()              # linked in from the run resumed
    assert pointers(out)["checkpoint-4"] == "hetrain-1/step-00000004"  # the source is left as it was


def test_save_total_limit_keeps_the_newest_as_stock_and_removes_their_hetrain_state(runs):
    out = runs["root"] / "limit2" / "out"
    assert pointers(out) == {"checkpoint-3": "hetrain/step-00000003", "checkpoint-4": "hetrain/step-00000004"}
    assert sorted(p.name for p in (out / "hetrain").glob("step-*")) == ["step-00000003", "step-00000004"]


def test_a_refused_run_leaves_the_checkpoints_as_they_were(whole, tmp_path):
    from hetrain.errors import UsageError
    from hetrain.integrations.transformers import Trainer

    d, _ = whole
    before = {p: p.read_bytes() for p in (d / "out").rglob("*") if p.is_file()}
    trainer = Trainer(model=gpt2(), args=arguments(str(d / "out")), train_dataset=Tokens())
    with pytest.raises(UsageError) as e:
        trainer.train(resume_from_checkpoint=str(tmp_path))
    assert "is not a checkpoint of hetrain's Trainer" in e.value.what and "pass a checkpoint-N" in e.value.fix
    assert {p: p.read_bytes() for p in (d / "out").rglob("*") if p.is_file()} == before
