"""A tiny Hugging Face GPT-2 and its token data, as the integration tests (Trainer, Fabric) train it."""

from __future__ import annotations

import torch

T, V = 12, 64     # tokens per sample, vocabulary


def token_data(n: int):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, V, (n, T), generator=g)
    y = x.clone()
    y[torch.rand(n, T, generator=g) < 0.3] = -100     # uneven counted tokens per sample
    return x, y


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n
        self.x, self.y = token_data(n)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def gpt2():
    """A tiny GPT-2 from a config (no download), in float64: the comparison is not blurred by
    rounding. GPT-2 rather than Llama: Llama's RMSNorm computes in float32 even in a float64 model,
    so its gradient carries float32 rounding of whatever scale passes through it (token weighting's
    provisional one does), about 6e-8 relative; GPT-2's LayerNorm stays in float64."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()
