"""A `hetrain sweep` objective whose even trials are declared too big for one card: on two 64 MiB
cards they run as a hetrain data-parallel job over both (the memory model shards them, fsdp),
the odd ones on one card each. The trained model is tiny; the declared need decides placement.

Every trial trains the same regression with full-batch SGD on fixed data, so a group trial's
value can be checked against one process running the same steps (the test's reference)."""

import torch

BATCH, STEPS, WIDTH = 32, 4, 16


def space(trial):
    return {"big": trial.number % 2 == 0, "lr": trial.suggest_float("lr", 1e-2, 1e-1, log=True)}


def memory(params):
    # 6M parameters under AdamW: 91.6 MiB of state, more than a 64 MiB card holds, half on each of two
    return {"params": 6_000_000 if params["big"] else 10_000, "batch": BATCH, "activation_bytes_per_sample": 1000}


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def model_and_opt(lr):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def train(params, ctx):
    x, y = data()
    model, opt = model_and_opt(params["lr"])
    if not ctx.group:
        for step in range(STEPS):
            with ctx.compute(samples=BATCH):
                loss = torch.nn.functional.mse_loss(model(x[step * BATCH:(step + 1) * BATCH]),
                                                    y[step * BATCH:(step + 1) * BATCH])
                opt.zero_grad()
                loss.backward()
                opt.step()
            ctx.report(loss.item(), step)
        return loss.item()
    import hetrain

    ht = hetrain.init(global_batch=BATCH, max_steps=STEPS, shuffle=False)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y),
                                     parallel=hetrain.DataParallel(sharding=ctx.sharding))
    for step in batches:
        for mb in step:
            with mb:
                xb, yb = mb.batch
                ht.backward(torch.nn.functional.mse_loss(model(xb), yb))
        ht.step()
        ctx.report(step.loss, step.index)
        last = step.loss
    ht.close()
    return last
