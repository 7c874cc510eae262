"""Small models the multi-process tests share."""

from __future__ import annotations

import torch
from torch import nn


class BlockNet(nn.Module):
    """Repeated blocks in a ModuleList: the units FSDP2 shards and checkpointing wraps."""

    def __init__(self, d: int = 8, h: int = 16, n: int = 2, block=None):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList((block or _linear_tanh)(h) for _ in range(n))
        self.out = nn.Linear(h, 1)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _linear_tanh(h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, h), nn.Tanh())


class Residual(nn.Module):
    """x + tanh(fc(x)): a shape-keeping block, so any number of them stack (pipelines cut between them)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))
