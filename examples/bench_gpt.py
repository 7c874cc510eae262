"""A model factory for `hetrain bench` (and `hetrain plan`): the demo's small GPT on the Python docs.

    hetrain bench --emulate a100-80g,rtx3090 --model-factory examples/bench_gpt.py:make

Yours returns the same three things: the model, its optimizer and the dataset, as you would pass
them to ht.prepare. Nothing trains on import (bench and plan import this file to call make()).
"""

import torch

from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.demo.text import ByteWindows, pydoc_bytes


def make():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=64, d_model=128, n_layers=4, n_heads=4))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), ByteWindows(pydoc_bytes(), 64)
