"""Train the demo GPT as a pipeline across mixed devices: stages sized by each device's speed.

    python -m hetrain run --emulate a100-80g:1.0,rtx3090:0.5 examples/pipeline_gpt.py

One process per (emulated) device; rank r runs stage r. hetrain times each block, gives the faster
device more of them, and prints the split with its reasons. The loop is hetrain's usual one: each
micro-batch's loss is recorded, and once all are in, the schedule (1F1B) runs them through the
stages; the first stage reads the inputs, the last the targets and computes the loss.
"""

import torch
import torch.nn.functional as F

import hetrain
from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes, split

ht = hetrain.init(global_batch=32, max_steps=40, grad_clip=1.0, seed=0)   # joins the job, reads --emulate

train = ByteWindows(split(pydoc_bytes())[0], seq_len=64)                   # (inputs, targets) windows
model = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=8, n_heads=2))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)


def loss_fn(logits, targets):                                # a mean over the samples it is given
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# model.parameters() and opt now hold this rank's stage only; model.module is the whole model
model, opt, batches = ht.prepare(model, opt, train, loss_fn=loss_fn,
                                 parallel=hetrain.Pipeline(micro_batches=8, schedule="1f1b"))

for step in batches:
    for mb in step:                      # the step's micro-batches, the same on every stage
        with mb:
            ht.backward(ht.loss(mb))     # recorded; the last one runs the schedule
    ht.step()                            # clip (the norm over every stage), optimizer step
    if step.index % 10 == 0 or step.index == ht.total_steps - 1:
        ht.print(f"step {step.index:3d}  loss {step.loss:.3f}")   # the whole global batch's mean loss

ht.summary()
ht.close()
