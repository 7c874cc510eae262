"""A stock Hugging Face Trainer script across mixed devices: the import is the one changed line.

    hetrain run --emulate a100-80g,rtx3090 examples/hf_trainer.py     # no GPU: an emulated pair
    hetrain run examples/hf_trainer.py                                 # one process per GPU

A tiny GPT-2 (built from a config: nothing is downloaded) learns byte-level text. The Trainer's
global batch is per_device_train_batch_size x gradient_accumulation_steps x devices = 16 x 2 x 2 =
64 samples a step, as on two equal GPUs; hetrain gives the A100 the larger share of it, runs each
share in micro-batches that fit the card, and weights the loss so the step's gradient is the
gradient of all 64. It evaluates every 20 steps, each device a part of the validation batches with
the metrics of all of them, and keeps the best checkpoint. Run it again with the same output_dir and `--resume` to continue from the
newest checkpoint-N (hetrain resumes exactly: no sample lost or repeated).
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.integrations.transformers import Trainer          # was: from transformers import Trainer


class ByteText(torch.utils.data.Dataset):
    """Windows of text as the Trainer's dicts: input_ids and labels (the model shifts them itself)."""

    def __init__(self, data, seq_len):
        self.windows = ByteWindows(data, seq_len=seq_len)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x, _ = self.windows[i]
        return {"input_ids": x.long(), "labels": x.long()}


text_train, text_valid = split(pydoc_bytes())
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
args = TrainingArguments(
    output_dir="out/hf_trainer",
    per_device_train_batch_size=16,
    gradient_accumulation_steps=2,
    max_steps=40,
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=4,
    logging_steps=10,
    save_steps=20,
    eval_strategy="steps",
    eval_steps=20,
    load_best_model_at_end=True,
    dataloader_num_workers=2,
    report_to="none",
)
trainer = Trainer(model=model, args=args, train_dataset=ByteText(text_train, seq_len=64),
                  eval_dataset=torch.utils.data.Subset(ByteText(text_valid, seq_len=64), range(256)))
result = trainer.train(resume_from_checkpoint=True if "--resume" in sys.argv else None)
if trainer.is_world_process_zero():
    shares = ", ".join(f"{d.device} {d.share} in micro-batches of {d.micro_batch}" for d in trainer.hetrain_plan.devices)
    print(f"global batch {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x "
          f"{len(trainer.hetrain_plan.devices)} = {trainer.hetrain_plan.global_batch}: {shares}")
    print(f"trained {result.global_step} steps, loss {result.training_loss:.3f}; best {trainer.state.best_metric:.3f} "
          f"eval loss at {trainer.state.best_model_checkpoint}")
