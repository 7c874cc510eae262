"""The smallest complete hetrain job: your model, your loss, your loop; hetrain splits the batch.

    hetrain run --emulate a100-80g,rtx3090 examples/minimal.py      # no GPU: an emulated pair
    hetrain run examples/minimal.py                                  # one process per GPU
"""

import torch
import torch.nn.functional as F

import hetrain

ht = hetrain.init(global_batch=96, epochs=3)

# A regression problem with a known answer: y = x · w_true + noise.
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=g)
w_true = torch.randn(32, 1, generator=g)
dataset = torch.utils.data.TensorDataset(x, x @ w_true + 0.01 * torch.randn(4096, 1, generator=g))

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, opt, batches = ht.prepare(model, opt, dataset)

for step in batches:
    for mb in step:                      # this device's share of the 96, in micro-batches
        with mb:
            xb, yb = mb.batch
            with ht.autocast():
                loss = F.mse_loss(model(xb), yb)
            ht.backward(loss)            # weighted by the micro-batch's size: big-batch math
    ht.step()
    if step.index % 40 == 0:
        ht.print(f"step {step.index:4d}  epoch {step.epoch}  loss {step.loss:.4f}  {step.samples_per_s:.0f} samples/s")

ht.summary()
ht.close()
