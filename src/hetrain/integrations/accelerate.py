"""Accelerate scripts across mixed devices: change one import.

    from hetrain.integrations.accelerate import Accelerator     # was: from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                            lr_scheduler)
    for epoch in range(epochs):
        for batch in train_dl:                       # this rank's micro-batches of one epoch's steps
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)   # weighted: the big-batch gradient
                optimizer.step()                     # the agreed global step, on this rank's last micro-batch
                lr_scheduler.step()
                optimizer.zero_grad()
        for batch in eval_dl:
            preds = accelerator.gather_for_metrics(model(**batch).logits)   # each sample once, in order
    accelerator.save_state("ckpt")                   # hetrain's exact checkpoint; load_state("ckpt") resumes

Launch with `hetrain run train.py` (which swaps the class in for an
unedited script too: integrations/swap.py). It is a subclass of accelerate.Accelerator: every
attribute of the stock class is there, and only what decides the split and the gradient sync is
hetrain's (accel/accelerator.py). The global batch is stock's on this many equal GPUs,
batch_size x gradient_accumulation_steps x processes, split unevenly; how the loop maps onto
hetrain's steps is in accel/loop.py, evaluation in accel/evaluation.py. Accelerate's own
distribution engines (DeepSpeed, FSDP, Megatron plugins) are refused in one line naming the fix.
"""

from __future__ import annotations

from . import require

require("accelerate", extra="hf", feature="hetrain.integrations.accelerate")

# After the check: the class is accelerate.Accelerator's subclass.
from .accel.accelerator import Accelerator

__all__ = ["Accelerator"]
