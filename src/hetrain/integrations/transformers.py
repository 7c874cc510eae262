"""The Hugging Face Trainer across mixed devices: change one import line.

    from hetrain.integrations.transformers import Trainer     # was: from transformers import Trainer

    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", per_device_train_batch_size=16,
                      gradient_accumulation_steps=2, max_steps=200), train_dataset=dataset)
    trainer.train()                                  # hetrain run train.py

The global batch is the stock Trainer's on this many equal GPUs, per_device_train_batch_size x
gradient_accumulation_steps x devices, split unevenly: per_device_train_batch_size becomes the
mean share of a device (hf/arguments.py has the rule and every argument's mapping). Each rank runs
its share in micro-batches sized to its memory, the loss weighted so the step's gradient is the
big-batch gradient, with hetrain's agreed step, OOM recovery and rebalancing (hf/trainer.py).
Checkpoints keep the Trainer's layout, checkpoint-N, beside hetrain's exact state (hf/checkpoints.py).
"""

from __future__ import annotations

from . import require

require("transformers", extra="hf", feature="hetrain.integrations.transformers")

# After the check: these import transformers, whose absence would otherwise be a bare ImportError.
from .hf.arguments import global_batch, job_config
from .hf.trainer import Trainer

__all__ = ["Trainer", "global_batch", "job_config"]
