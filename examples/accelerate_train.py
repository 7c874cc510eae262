"""An Accelerate training script across mixed devices: the import is the one changed line.

    hetrain run --emulate a100-80g,rtx3090 examples/accelerate_train.py           # no GPU: an emulated pair
    hetrain run --emulate a100-80g,rtx3090 examples/accelerate_train.py --resume  # continue from out/accelerate
    hetrain run examples/accelerate_train.py                                       # one process per GPU

A tiny GPT-2 (built from a config: nothing is downloaded) learns byte-level text in the script's
own loop. The global batch is stock Accelerate's on this many equal GPUs, batch_size x
gradient_accumulation_steps x processes = 16 x 2 x 2 = 64 windows a step; hetrain gives the A100
the larger share, each rank iterates its own micro-batches, and optimizer.step() on a rank's last
one is the step of the whole batch. The evaluation's gather_for_metrics returns every window once,
in order, though each rank computed a different number of them.
"""

import math
import sys

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.integrations.accelerate import Accelerator     # was: from accelerate import Accelerator


class ByteText(Dataset):
    def __init__(self, data, seq_len):
        self.windows = ByteWindows(data, seq_len=seq_len)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x, _ = self.windows[i]
        return {"input_ids": x.long(), "labels": x.long()}


EPOCHS, OUT = 2, "out/accelerate"
text_train, text_val = split(pydoc_bytes())
train_data = torch.utils.data.Subset(ByteText(text_train, 64), range(1280))     # 20 steps an epoch
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
train_loader = DataLoader(train_data, batch_size=16, shuffle=True)
eval_loader = DataLoader(torch.utils.data.Subset(ByteText(text_val, 64), range(100)), batch_size=16)
steps = EPOCHS * math.ceil(len(train_data) / (16 * 2 * 2))
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / steps))

accelerator = Accelerator(gradient_accumulation_steps=2)
model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, train_loader,
                                                                             eval_loader, scheduler)
first = 0
if "--resume" in sys.argv:
    accelerator.load_state(OUT)
    first = 1                              # saved after epoch 0
for epoch in range(first, EPOCHS):
    model.train()
    for batch in train_loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in eval_loader:
            logits = model(**batch).logits[:, :-1]
            per_window = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                           reduction="none").view(len(logits), -1).mean(1)
            losses.append(accelerator.gather_for_metrics(per_window))
    every = torch.cat(losses)
    accelerator.print(f"epoch {epoch}: last step's loss {accelerator.step_loss:.3f}, evaluation loss "
                      f"{every.mean():.3f} over {len(every)} windows (each once)")
    if epoch == 0:
        accelerator.save_state(OUT)
accelerator.end_training()
