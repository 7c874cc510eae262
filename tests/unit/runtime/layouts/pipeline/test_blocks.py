"""Finding a model's blocks, padding micro-batches, and measuring blocks (one process, no group)."""

from __future__ import annotations

import pytest
import torch

from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.errors import UsageError
from hetrain.demo.gpt import GPTEmbed, GPTHead
from hetrain.runtime.layouts.pipeline.blocks import PipelineParts, StageModule, find_parts, profile_blocks
from hetrain.runtime.layouts.pipeline.schedule import _padded_rows


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2))


def test_gpt_parts_compose_to_the_model():
    model = gpt()
    parts = find_parts(model)
    assert isinstance(parts.first, GPTEmbed) and isinstance(parts.last, GPTHead) and len(parts.blocks) == 3
    x = torch.randint(0, 32, (2, 8))
    whole = StageModule(parts, 0, 3, is_first=True, is_last=True)
    assert torch.equal(whole(x), model(x))
    # stages share the model's own parameters (no copies); the tied weight is on both ends
    first = StageModule(parts, 0, 1, is_first=True, is_last=False)
    last = StageModule(parts, 1, 3, is_first=False, is_last=True)
    assert first.first.tok.weight is model.tok.weight is last.last.head.weight


def test_sequential_and_module_list_are_stacks_of_blocks():
    seq = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    assert find_parts(seq).blocks == tuple(seq) and find_parts(seq).first is None
    assert len(find_parts(torch.nn.ModuleList([torch.nn.Linear(2, 2)])).blocks) == 1


def test_a_model_without_a_block_list_says_what_to_pass():
    class Opaque(torch.nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(UsageError) as e:
        find_parts(Opaque())
    assert "cannot split a Opaque" in e.value.what and "PipelineParts(first=" in e.value.fix
    with pytest.raises(UsageError, match="no blocks"):
        PipelineParts(blocks=())


def test_micro_batches_are_padded_to_one_size_with_real_rows_marked():
    rows, pick = _padded_rows((3, 3, 2, 2), 3)          # 10 rows in 4 micro-batches of µ = 3
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, 8, 9, -1]
    assert pick.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 6, 8, 9, 8]
    rows, _ = _padded_rows((2, 2, 2, 2), 2)
    assert (rows >= 0).all()
    # any sizes up to µ, each padded to µ with its first row
    rows, pick = _padded_rows((1, 5, 4), 5)
    assert rows.tolist() == [0, -1, -1, -1, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1]
    assert pick.tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 6]


def test_profile_measures_each_part_and_the_tied_weight():
    model = gpt()
    prof = profile_blocks(find_parts(model), torch.randint(0, 32, (4, 8)), repeats=1)
    assert prof.n_blocks == 3 and prof.first is not None and prof.last is not None
    assert all(b.seconds > 0 and b.activation_bytes > 0 for b in prof.blocks)
    block_params = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert prof.blocks[0].param_bytes == block_params
    assert prof.tied_param_bytes == model.tok.weight.numel() * 4
    assert prof.param_bytes == model.num_params() * 4          # the tied weight counted once
    assert prof.boundary_bytes == 8 * 16 * 4                    # one sample's (seq, d_model) activation
    assert all(p.grad is None for p in model.parameters())      # measuring leaves no gradients behind


def test_profile_scaled_to_the_fastest_device():
    from hetrain.runtime.layouts.pipeline.sizing import _scaled

    prof = profile_blocks(find_parts(gpt()), torch.randint(0, 32, (2, 8)), repeats=1)
    half = _scaled(prof, 0.5)      # measured on a device half as fast as the fastest
    assert half.blocks[1].seconds == pytest.approx(prof.blocks[1].seconds / 2)
    assert half.last.seconds == pytest.approx(prof.last.seconds / 2)
    assert half.blocks[1].activation_bytes == prof.blocks[1].activation_bytes


def test_standard_stacks_of_blocks_are_found_without_help():
    import torch
    from torch import nn

    from hetrain.runtime.layouts.pipeline.blocks import find_parts, repeated_blocks

    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=3, norm=nn.LayerNorm(16), enable_nested_tensor=False)
    parts = find_parts(encoder)                       # the encoder itself: its layers, then its norm
    x = torch.randn(2, 5, 16)
    encoder.eval()
    y = x
    for block in parts.blocks:
        y = block(y)
    assert len(parts.blocks) == 3 and torch.allclose(parts.last(y), encoder(x), atol=1e-6)

    class Wrapped(nn.Module):                         # a stock encoder inside a user's model
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
            self.heads = nn.ModuleList([nn.Linear(16, 2), nn.Linear(16, 2)])   # identical, but smaller

    name, blocks = repeated_blocks(Wrapped())
    assert name == "encoder.layers" and len(blocks) == 4

    class DecoderLayer(nn.Module):                    # the shape of Hugging Face Llama/GPT-2 models
        def __init__(self, d):
            super().__init__()
            self.attn, self.mlp = nn.Linear(d, d), nn.Linear(d, 4 * d)

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([DecoderLayer(8) for _ in range(6)])

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.lm_head = Inner(), nn.Linear(8, 100)

    name, blocks = repeated_blocks(CausalLM())
    assert name == "model.layers" and len(blocks) == 6
    mixed = nn.Module()
    mixed.stack = nn.ModuleList([DecoderLayer(8), DecoderLayer(16)])   # not identical: not a stack
    assert repeated_blocks(mixed) is None
