"""TRL's trainers across mixed devices: change one import.

    from hetrain.integrations.trl import SFTTrainer       # was: from trl import SFTTrainer
    from hetrain.integrations.trl import DPOTrainer       # was: from trl import DPOTrainer

    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir="out", packing=True, max_length=512,
                         per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=100),
                         train_dataset=dataset, processing_class=tokenizer)
    trainer.train()                                  # hetrain run sft.py

Each is TRL's own class (its data preparation, packing, reference model, compute_loss and metrics)
on hetrain's Trainer (hetrain.integrations.transformers: the global batch rule, uneven shares,
the agreed step, checkpoints). `hetrain_trainer(cls)` makes the same for another Trainer subclass
(trl.RewardTrainer, your own); those that cannot run under hetrain's loop are refused in one line
(trl_parts/trainers.py says which and why).
"""

from __future__ import annotations

from . import require

require("transformers", extra="hf", feature="hetrain.integrations.trl")
trl = require("trl", extra="hf", feature="hetrain.integrations.trl")

# After the checks: these import transformers and TRL, whose absence would otherwise be a bare ImportError.
from .hf.trainer import Trainer
from .trl_parts.trainers import TrlLoop, hetrain_trainer


def _hetrains(cls: type) -> type:
    """Under `hetrain run`'s class swap (integrations/swap.py) TRL's class is hetrain's already."""
    return cls if issubclass(cls, Trainer) else hetrain_trainer(cls)


SFTTrainer = _hetrains(trl.SFTTrainer)
DPOTrainer = _hetrains(trl.DPOTrainer)

__all__ = ["DPOTrainer", "SFTTrainer", "TrlLoop", "hetrain_trainer"]
