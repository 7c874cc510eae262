"""A Fabric script in the form of Lightning's examples/fabric/language_model/train.py, with only
the import line changed (`import hetrain.integrations.lightning as L`): no fabric.launch(), a model
called as model(input, target), clip_gradients(clip_val=) after every backward, and a validation
loader set up beside the training one. Each rank writes what it saw to OUT_DIR/rank{r}.json.

    hetrain run --emulate a100-80g,rtx3090 fabric_language_model.py OUT_DIR
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

import hetrain.integrations.lightning as L

VOCAB = 16


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, inputs, target):
        return F.log_softmax(self.out(self.emb(inputs)), -1).view(-1, VOCAB)


def main():
    L.seed_everything(42)
    fabric = L.Fabric()
    x = torch.randint(0, VOCAB, (200, 6))
    dataset = TensorDataset(x, (x + 1) % VOCAB)
    train_dataloader, val_dataloader = get_dataloaders(dataset)
    model = Transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    train_dataloader, val_dataloader = fabric.setup_dataloaders(train_dataloader, val_dataloader)
    for epoch in range(2):
        for batch in train_dataloader:
            input, target = batch
            loss = F.nll_loss(model(input, target), target.view(-1))
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, clip_val=0.25)
            optimizer.step()
            optimizer.zero_grad()
        val_loss = validate(fabric, model, val_dataloader)
        fabric.print(f"val loss {val_loss.item():.4f}")
    with open(f"{sys.argv[1]}/rank{fabric.global_rank}.json", "w") as f:
        json.dump({"val_batches": len(val_dataloader), "world": fabric.world_size,
                   "shares": list(fabric.strategy.engine.plan.shares)}, f)


@torch.no_grad()
def validate(fabric, model, val_dataloader):
    model.eval()
    losses = torch.zeros(len(val_dataloader))
    for k, batch in enumerate(val_dataloader):
        input, target = batch
        losses[k] = F.nll_loss(model(input, target), target.view(-1)).item()
    model.train()
    return losses.mean()


def get_dataloaders(dataset):
    generator = torch.Generator().manual_seed(42)
    train_dataset, val_dataset = random_split(dataset, [160, 40], generator=generator)
    return (DataLoader(train_dataset, batch_size=8, shuffle=True),
            DataLoader(val_dataset, batch_size=4, shuffle=False))


if __name__ == "__main__":
    main()
