"""A small model factory for the `hetrain bench` tests: an MLP on random regression data."""

import torch


def make():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), data


def not_a_factory():
    return "a model"


if __name__ == "__main__":
    raise SystemExit("training would start here; `hetrain bench` must not run it")
