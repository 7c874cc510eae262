"""Optuna's own objective, as written for study.optimize, run by `hetrain sweep`: the device from
hetrain.sweep (checked against the worker's environment), the pruner through trial.report and
should_prune. Wide trials declare a need only the big card holds (memory(params)); the test also
runs a copy without memory(), whose later trials are placed by the first trial's measured peak."""

import os

import optuna
import torch

import hetrain

BATCH, STEPS = 32, 6


def memory(params):
    return {"params": 9 * params["width"] + 1, "batch": BATCH, "activation_bytes_per_sample": 400 * params["width"]}


def objective(trial):
    width = trial.suggest_categorical("width", [16, 512])
    lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
    device = hetrain.sweep.device()
    assert device == os.environ["HETRAIN_SWEEP_DEVICE"], (device, os.environ.get("HETRAIN_SWEEP_DEVICE"))
    trial.set_user_attr("ran_on", hetrain.sweep.context().label)
    torch.manual_seed(trial.number)
    x = torch.randn(BATCH, 8, device=device)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(STEPS):
        with hetrain.sweep.compute(samples=BATCH):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        trial.report(loss.item(), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return loss.item()
