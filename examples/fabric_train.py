"""Lightning Fabric across mixed devices: a stock Fabric loop, with only the strategy changed.

    hetrain run --emulate a100-80g,rtx3090 examples/fabric_train.py     # no GPU: an emulated pair
    hetrain run examples/fabric_train.py                                 # one process per GPU

`DataLoader(batch_size=16)` on 2 devices is a global batch of 32, as in stock Fabric; hetrain
splits it unevenly (the A100 takes the larger share), each rank runs its share in micro-batches
that fit its memory (`for batch in loader` yields them), fabric.backward weights each one so the
step's gradient is the whole global batch's, and optimizer.step() after the rank's last micro-batch
is the one agreed optimizer step. `--faults "oom:rank=1,step=5,phase=backward"` makes the 3090 run
out of memory in a backward: both ranks agree, its micro-batch is halved and the step redone. An
OOM in a forward cannot be redone by this loop (every rank stops with one error); the step form,
`for step in fabric.strategy.steps(): for mb in step: with mb:`, redoes that too.
"""

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from hetrain import Memory
from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.integrations.lightning import HetrainStrategy

fabric = Fabric(strategy=HetrainStrategy(grad_clip=1.0, memory=Memory(max_micro_batch=8)))
fabric.launch()                                   # joins the job `hetrain run` started; reads --emulate

model = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = fabric.setup(model, optimizer)

text_train, text_val = split(pydoc_bytes())
train_windows = torch.utils.data.Subset(ByteWindows(text_train, seq_len=64), range(32 * 15))   # 15 steps an epoch
loader = fabric.setup_dataloaders(DataLoader(train_windows, batch_size=16, shuffle=True))
val_loader = fabric.setup_dataloaders(DataLoader(ByteWindows(text_val, seq_len=64), batch_size=64))


def loss_of(batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


for epoch in range(2):
    for batch in loader:                  # this rank's micro-batches of each global step
        optimizer.zero_grad()             # a no-op inside the step: the micro-batches accumulate
        fabric.backward(loss_of(batch))   # weighted by the micro-batch's size
        step = optimizer.step()           # None until this rank's last micro-batch; then the global step
        if step is not None and step.index % 5 == 4:
            fabric.print(f"epoch {epoch}  step {step.index + 1:2d}  loss {step.loss:.4f}")

# Evaluation loaders are Fabric's as usual: every rank sees all of it, so no collective is needed.
model.eval()
with torch.no_grad():
    val = torch.stack([loss_of(batch) for batch, _ in zip(val_loader, range(4))]).mean()
fabric.print(f"validation loss {val.item():.4f} on {4 * 64} windows")

fabric.strategy.engine.summary()          # every device's busy time, memory and share, side by side
fabric.strategy.close()
