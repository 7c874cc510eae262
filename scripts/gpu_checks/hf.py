"""The Hugging Face Trainer on CUDA (a world of one, so its group is NCCL): a tiny GPT-2 built from
a config (nothing downloaded) trains 6 steps through hetrain's Trainer, logging and saving on the
way (where the Trainer's own collectives run: the FLOPs count, the checkpoint)."""

from __future__ import annotations

import math
from pathlib import Path

from common import Claims, device_of, main, skipped


def hf_trainer(args) -> dict:
    try:
        from transformers import TrainingArguments
    except ImportError as e:
        return skipped(f"transformers is not installed ({e})")
    from hf_tiny import Tokens, gpt2

    from hetrain.integrations.transformers import Trainer

    c = Claims()
    out = Path(args.scratch) / "hf-trainer"
    targs = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                              max_steps=6, learning_rate=1e-3, logging_steps=2, save_strategy="steps", save_steps=3,
                              report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                              use_cpu=device_of(args).type == "cpu")
    trainer = Trainer(model=gpt2().float(), args=targs, train_dataset=Tokens(256),
                      hetrain={"reporting": {"verbose": False}})
    result = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    where = {p.device.type for p in trainer.model.parameters()}
    c.note("losses", losses)
    c.note("total_flos", trainer.state.total_flos)
    c.note("checkpoints", sorted(p.name for p in out.glob("checkpoint-*")))
    plan = getattr(trainer, "hetrain_plan", None)
    c.note("plan", [(d.device, d.share, d.micro_batch, d.precision) for d in plan.devices] if plan else None)
    c.expect(result.global_step == 6, f"6 optimizer steps (got {result.global_step})")
    c.expect(bool(losses) and all(math.isfinite(x) for x in losses), "every logged loss is finite")
    c.expect((out / "checkpoint-3").is_dir() and (out / "checkpoint-6").is_dir(), "checkpoints at steps 3 and 6")
    c.expect(trainer.state.total_flos > 0, "the FLOPs count was gathered (store_flos' collective)")
    c.expect(where == {device_of(args).type}, f"the model trained on {device_of(args).type} (on {sorted(where)})")
    return c.outcome(f"6 steps on {sorted(where)}, loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no loss")


STEPS = {"hf-trainer": (hf_trainer, "the Trainer on a CUDA device, its collectives on NCCL")}

if __name__ == "__main__":
    main(STEPS)
