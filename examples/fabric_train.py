"""Lightning Fabric across mixed devices: Fabric's verbs, hetrain's uneven shares underneath.

    hetrain run --emulate a100-80g,rtx3090 examples/fabric_train.py     # no GPU: an emulated pair
    hetrain run examples/fabric_train.py                                 # one process per GPU

The A100 gets the larger share of every global batch, each rank runs its share in micro-batches
that fit its memory, and fabric.backward weights each micro-batch's loss so that the step's
gradient is the gradient of the whole global batch. `--faults "oom:rank=1,step=5"` makes the 3090
run out of memory at step 5: both ranks agree, its micro-batch is halved and the step redone.
"""

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.integrations.lightning import HetrainStrategy
from hetrain import Memory

strategy = HetrainStrategy(global_batch=32, max_steps=30, grad_clip=1.0, memory=Memory(max_micro_batch=8))
fabric = Fabric(strategy=strategy)
fabric.launch()                                   # joins the job `hetrain run` started; reads --emulate

text_train, text_val = split(pydoc_bytes())
# The training data first: hetrain measures the model on it to size every device's share.
# No batch_size or sampler: hetrain splits the global batch; shuffle is the DataLoader's.
loader = fabric.setup_dataloaders(DataLoader(ByteWindows(text_train, seq_len=64), shuffle=True))
val_loader = fabric.setup_dataloaders(DataLoader(ByteWindows(text_val, seq_len=64), batch_size=64))

model = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = fabric.setup(model, optimizer)  # hetrain.prepare: plan the shares, wrap DDP


def loss_of(batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


for step in loader:                       # one optimizer step over all 32 samples of the step
    micro_batches = 0
    for mb in step:                       # this device's share, in micro-batches that fit
        with mb:                          # an OOM in here is recovered, agreed with the peers
            fabric.backward(loss_of(mb.batch))   # weighted by the micro-batch's size
        micro_batches += 1
    optimizer.step()                      # hetrain's step: agreement, clip, optimizer, rebalance
    if step.index % 5 == 0 or step.index == 29:
        fabric.print(f"step {step.index:2d}  loss {step.loss:.4f}  (rank 0: {len(step.indices)} samples in "
                     f"{micro_batches} micro-batch(es))")

# Evaluation loaders are Fabric's as usual: every rank sees all of it, so no collective is needed.
model.eval()
with torch.no_grad():
    val = torch.stack([loss_of(batch) for batch, _ in zip(val_loader, range(4))]).mean()
fabric.print(f"validation loss {val.item():.4f} on {4 * 64} windows")

strategy.engine.summary()                 # every device's busy time, memory and share, side by side
strategy.close()
