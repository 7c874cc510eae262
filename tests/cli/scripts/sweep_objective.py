"""A tiny objective for `hetrain sweep` tests: an MLP regression whose width decides its memory.

Even-numbered trials are wide (their declared need only fits the big card), odd ones narrow;
trials 4 and 7 report a loss 100 above the rest, for the median pruner to stop."""

import torch

BATCH, STEPS = 32, 6
WIDE, NARROW = 512, 16


def space(trial):
    return {"width": WIDE if trial.number % 2 == 0 else NARROW,
            "lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
            "bad": trial.number in (4, 7)}


def memory(params):
    # declared generously: a wide trial needs 6.5 MiB of activations, a narrow one 0.2 MiB
    return {"params": 9 * params["width"] + 1, "batch": BATCH, "activation_bytes_per_sample": 400 * params["width"]}


def train(params, ctx):
    torch.manual_seed(ctx.number)
    x = torch.randn(BATCH * 4, 8)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, params["width"]), torch.nn.Tanh(), torch.nn.Linear(params["width"], 1))
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
    loss = None
    for step in range(STEPS):
        with ctx.compute(samples=BATCH):
            i = (step % 4) * BATCH
            loss = torch.nn.functional.mse_loss(model(x[i:i + BATCH]), y[i:i + BATCH])
            opt.zero_grad()
            loss.backward()
            opt.step()
        ctx.report(loss.item() + (100.0 if params["bad"] else 0.0), step)
    return loss.item()
