"""Train the demo GPT as a pipeline across mixed devices: stages sized by each device's speed.

    python -m hetrain run --emulate a100-80g:1.0,rtx3090:0.5 examples/pipeline_gpt.py

One process per (emulated) device; rank r runs stage r. hetrain times each block, gives the faster
device more of them, and prints the split with its reasons. Every rank reads the same global
batch (the same seeded sampler); the first stage uses the inputs, the last the targets.
"""

import torch
import torch.nn.functional as F

import hetrain
from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.parallel import pipeline
from hetrain.runtime.loop.sampler import GlobalCursorSampler

GLOBAL_BATCH, STEPS = 32, 40

ht = hetrain.init(global_batch=GLOBAL_BATCH, seed=0)        # joins the job, reads --emulate

train = ByteWindows(split(pydoc_bytes())[0], seq_len=64)
model = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=8, n_heads=2))


def loss_fn(logits, targets):                                # a mean over the samples it is given
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def global_batch(sampler):
    x, y = zip(*(train[i] for i in sampler.next_step().indices))
    return torch.stack(x), torch.stack(y)


sampler = GlobalCursorSampler(len(train), GLOBAL_BATCH, seed=0)
example, _ = global_batch(GlobalCursorSampler(len(train), 4, seed=1))   # a few samples to time the blocks
pp = pipeline.prepare(ht, model, loss_fn=loss_fn, micro_batches=8, schedule="1f1b", example=example)
opt = torch.optim.AdamW(pp.parameters(), lr=3e-3)           # this stage's parameters only

for step in range(STEPS):
    x, y = global_batch(sampler)
    loss = pp.step(x, y)                 # all micro-batches through the pipeline, forward and backward
    pp.clip_grad_norm_(1.0)              # the whole model's norm, over every stage
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % 10 == 0 or step == STEPS - 1:
        ht.print(f"step {step:3d}  loss {loss:.3f}")

ht.print(f"stage peaks: {pp.peak_in_flight} micro-batches in flight on rank 0; "
         f"bubble fraction {pp.bubble_fraction:.0%} (emulated devices)")
pp.close()
ht.close()
