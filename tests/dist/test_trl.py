"""TRL's trainers on hetrain (hetrain.integrations.trl): SFT with packing and DPO with a reference
model, a tiny Llama from its config and an in-memory tokenizer (tests/trl_tiny.py), on two emulated
ranks with uneven shares, equal the same TRL trainer in one process at the same global batch.

Why not to 1e-12, though the models are float64: TRL computes every log-probability in float32
(its chunked LM-head kernel, trl/kernels/chunked_logprob.py, accumulates in float32 whatever the
model's dtype), so each token's loss carries float32 rounding, and the two runs add the same
tokens in different groupings (stock: 2 micro-batches of 8; hetrain: 4, 4, 2 on one rank and 6 on
the other). Measured: one SGD step's gradient agrees to 3e-7 relative (the float32 kernel's own
spread; the model's float64 logits agree to 3e-15 across groupings); after AdamW steps the weights
agree to about 2e-6 (Adam divides each gradient by its own running size, so a rounding of a small
gradient moves its weight by as much as a large one), the losses to about 1e-7. The tolerances
below are 5x those; each test also shows a wrong weighting is caught by them.
"""

from __future__ import annotations

import importlib.util

import pytest

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason='needs pip install "hetrain[hf]"')]

QUIET = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_VERBOSITY": "error",
         "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
STEPS, LR = 4, 1e-2
WEIGHTS_TOL, LOSS_TOL = 1e-5, 1e-6


def write_plan(path, shares, micros) -> str:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (1.0, 0.67), shares, micros)))
    path.write_text(Plan(global_batch=sum(shares), devices=devices).to_json())
    return str(path)


def hetrain_options(plan: str, **more) -> dict:
    return {"plan": plan, "rebalancing": {"enabled": False}, "reporting": {"verbose": False},
            "emulation": {"cluster": "a100-80g,rtx3090"}, **more}


def common(out_dir, per_device: int, accum: int) -> dict:
    """The same run in both: sequential data (both samplers then take the same rows), float64 (no
    bf16, which TRL turns on by default), AdamW, a linear schedule, every step logged."""
    return dict(output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
                max_steps=STEPS, learning_rate=LR, optim="adamw_torch", bf16=False, report_to="none", use_cpu=True,
                disable_tqdm=True, logging_steps=1, save_strategy="no", train_sampling_strategy="sequential")


def outcome(trainer, result) -> dict:
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {"train_loss": result.training_loss, "losses": [e["loss"] for e in logs], "logs": logs,
            "params": [p.detach().clone() for p in trainer.model.parameters()]}


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


# -- SFT with packing -----------------------------------------------------------------------------
SFT_DOCS = 400                        # packed into 122 sequences of at most 32 tokens
SFT_SHARES, SFT_MICROS = (10, 6), (4, 6)   # 16 packed sequences a step: rank 0 runs 4, 4, 2; rank 1 one of 6


def sft(trainer_cls, out_dir, per_device, accum, **kwargs):
    from trl import SFTConfig
    from trl_tiny import llama, text_dataset, tokenizer

    args = SFTConfig(packing=True, max_length=32, **common(out_dir, per_device, accum))
    trainer = trainer_cls(model=llama(), args=args, train_dataset=text_dataset(SFT_DOCS), processing_class=tokenizer(),
                          **kwargs)
    return outcome(trainer, trainer.train())


def sft_worker(out_dir, plan, weighting=None):
    from hetrain.integrations.trl import SFTTrainer

    extra = {"loss_weighting": weighting} if weighting else {}
    return sft(SFTTrainer, out_dir, 4, 2, hetrain=hetrain_options(plan, **extra))   # 4 x 2 x 2 ranks = 16


def worker(rank, world, d, sft_plan, dpo_plan):
    """Every hetrain run of this file in turn, in one process group: SFT, SFT weighted by samples,
    DPO, and DPO weighted by tokens (last: it raises, on each rank, before its first step)."""
    import traceback

    out = {"sft": sft_worker(f"{d}/sft", sft_plan), "sft_samples": sft_worker(f"{d}/samples", sft_plan, "samples"),
           "dpo": dpo_worker(f"{d}/dpo", dpo_plan)}
    try:
        dpo_worker(f"{d}/tokens", dpo_plan, "tokens")
        out["dpo_tokens"] = None
    except Exception:
        out["dpo_tokens"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory):
    import trl

    d = tmp_path_factory.mktemp("trl")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in QUIET.items():
            mp.setenv(k, v)
        stock = {"sft": sft(trl.SFTTrainer, str(d / "stock_sft"), 8, 2),        # one process: 8 x 2 = 16
                 "dpo": dpo(trl.DPOTrainer, str(d / "stock_dpo"), 4, 2)}         # one process: 4 x 2 = 8 pairs
        sft_plan = write_plan(d / "sft_plan.json", SFT_SHARES, SFT_MICROS)
        dpo_plan = write_plan(d / "dpo_plan.json", DPO_SHARES, DPO_MICROS)
        results = run_ranks(worker, 2, str(d), sft_plan, dpo_plan, env=QUIET, timeout=400)
    return stock, {k: [r[k] for r in results] for k in results[0]}


def test_sft_with_packing_on_uneven_shares_equals_trl_in_one_process(trl_runs):
    stock, ranks = trl_runs[0]["sft"], trl_runs[1]["sft"]
    assert len(stock["losses"]) == STEPS
    for r in ranks:
        assert r["losses"] == pytest.approx(stock["losses"], abs=LOSS_TOL)
        assert r["train_loss"] == pytest.approx(stock["train_loss"], abs=LOSS_TOL)
        assert max_diff(r["params"], stock["params"]) <= WEIGHTS_TOL
        for mine, theirs in zip(r["logs"], stock["logs"]):
            # TRL's metrics, agreed over both ranks: the tokens seen are a count, the same exactly
            assert mine["num_tokens"] == theirs["num_tokens"]
            assert mine["entropy"] == pytest.approx(theirs["entropy"], rel=1e-3)
            assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"])


def test_sft_weighted_by_samples_is_caught_by_the_tolerance(trl_runs):
    # Stock SFT divides the summed token losses by the global batch's tokens; weighting each
    # micro-batch's token mean by its sequences instead is a different gradient, well outside.
    stock, wrong = trl_runs[0]["sft"], trl_runs[1]["sft_samples"]
    assert max_diff(wrong[0]["params"], stock["params"]) > 100 * WEIGHTS_TOL


# -- DPO with a reference model -------------------------------------------------------------------
PAIRS = 64
DPO_SHARES, DPO_MICROS = (5, 3), (2, 3)    # 8 pairs a step: rank 0 runs 2, 2, 1; rank 1 one of 3


def dpo(trainer_cls, out_dir, per_device, accum, **kwargs):
    from trl import DPOConfig
    from trl_tiny import llama, preference_dataset, tokenizer

    args = DPOConfig(max_length=32, **common(out_dir, per_device, accum))
    trainer = trainer_cls(model=llama(), ref_model=llama(), args=args, train_dataset=preference_dataset(PAIRS),
                          processing_class=tokenizer(), **kwargs)
    return outcome(trainer, trainer.train())


def dpo_worker(out_dir, plan, weighting=None):
    from hetrain.integrations.trl import DPOTrainer

    extra = {"loss_weighting": weighting} if weighting else {}
    return dpo(DPOTrainer, out_dir, 2, 2, hetrain=hetrain_options(plan, **extra))    # 2 x 2 x 2 ranks = 8


def test_dpo_on_uneven_shares_weights_by_pairs_and_equals_trl_in_one_process(trl_runs):
    stock, ranks = trl_runs[0]["dpo"], trl_runs[1]["dpo"]
    assert stock["losses"][0] == pytest.approx(0.6931471805599453, abs=1e-6)   # log 2: the policy is its reference
    for r in ranks:
        assert r["losses"] == pytest.approx(stock["losses"], abs=LOSS_TOL)
        assert max_diff(r["params"], stock["params"]) <= WEIGHTS_TOL
        # TRL's metrics are agreed as the mean over every micro-batch of every rank (stock's mean over
        # equal micro-batches); the tokens seen, a total, are the same exactly
        assert [e["num_tokens"] for e in r["logs"]] == [e["num_tokens"] for e in stock["logs"]]
    # DPO's loss is a mean over pairs: weighting each micro-batch by its tokens instead is caught
    # (the tokens are counted from labels, which DPO's batches do not have: one line naming the fix),
    # on every rank.
    for error in trl_runs[1]["dpo_tokens"]:
        assert error is not None and "loss_weighting='tokens' but the batch has no 'labels'" in error, error
