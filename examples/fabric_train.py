"""Lightning Fabric across mixed devices: a stock Fabric loop, with only the import of Fabric changed.

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
from torch.utils.data import DataLoader

from hetrain import Memory
from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.integrations.lightning import Fabric, HetrainStrategy     # the changed line

fabric = Fabric(strategy=HetrainStrategy(memory=Memory(max_micro_batch=8)))   # joins the job: no launch()

model = GPT(GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = fabric.setup(model, optimizer)

text_train, text_val = split(pydoc_bytes())
train_windows = torch.utils.data.Subset(ByteWindows(text_train, seq_len=64), range(32 * 15))   # 15 steps an epoch
loader = fabric.setup_dataloaders(DataLoader(train_windows, batch_size=16, shuffle=True))
val_windows = torch.utils.data.Subset(ByteWindows(text_val, seq_len=64), range(256))
val_loader = fabric.setup_dataloaders(DataLoader(val_windows, batch_size=64))       # split across the ranks


def loss_of(batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


for epoch in range(2):
    for batch in loader:                  # this rank's micro-batches of each global step
        optimizer.zero_grad()             # a no-op inside the step: the micro-batches accumulate
        fabric.backward(loss_of(batch))   # weighted by the micro-batch's size
        fabric.clip_gradients(model, optimizer, max_norm=1.0)   # clips the step's final gradient, in the step
        step = optimizer.step()           # None until this rank's last micro-batch; then the global step
        if step is not None and step.index % 5 == 4:
            fabric.print(f"epoch {epoch}  step {step.index + 1:2d}  loss {step.loss:.4f}")

# An evaluation loader is split across the ranks by the plan's shares (each sample once): sum on
# each rank, then gather, as stock Fabric scripts do.
model.eval()
with torch.no_grad():
    total = sum((loss_of(batch) * len(batch[0]) for batch in val_loader), torch.zeros(()))
val = fabric.all_gather(total).sum() / len(val_loader.dataset)
fabric.print(f"validation loss {val.item():.4f} on {len(val_loader.dataset)} windows")

fabric.strategy.engine.summary()          # every device's busy time, memory and share, side by side
fabric.strategy.close()
