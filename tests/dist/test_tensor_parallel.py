"""Tensor parallelism (DTensor Colwise/Rowwise plans that tp_plan finds) gives the single-process
forward and gradients, on gloo CPU with 2 ranks: the demo GPT, and a small llama-like model (RMSNorm,
separate q/k/v/o with grouped key/value heads viewed as (num_heads, head_dim), SwiGLU MLP).

Reference: the same model, built from the same seed, run whole in each rank's process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks
from hetrain import Reporting

pytestmark = pytest.mark.dist


def make():
    from hetrain.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 32, (6, 8), generator=g), torch.randint(0, 32, (6, 8), generator=g)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # the counts, not -1: under tensor parallelism they must be this rank's (localize_heads)
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
                for p in (self.k_proj, self.v_proj))
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.self_attn, self.mlp = LlamaAttention(d, heads=4, kv_heads=2), SwiGLU(d, 24)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaLayer(d) for _ in range(layers))
        self.norm, self.lm_head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def make_llama():
    torch.manual_seed(0)
    model = Llama().double()
    for p in model.parameters():      # nonzero norm weights too, so their gradients are tested
        nn.init.normal_(p, std=0.3)
    return model


def errors(model, ref, x, y):
    """The largest forward and gradient differences from the single-process reference."""
    from hetrain.runtime.layouts.tensor.shard import full_grad

    ref_logits = ref(x)
    F.cross_entropy(ref_logits.flatten(0, 1), y.flatten()).backward()
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    refs = dict(ref.named_parameters())
    grads = max((full_grad(p) - refs[n].grad).abs().max().item() for n, p in model.named_parameters())
    return (logits - ref_logits).abs().max().item(), grads


def tp_worker(rank, world):
    import hetrain
    from hetrain.errors import UsageError
    from hetrain.runtime.layouts.tensor.shard import tensor_parallel

    ref, x, y = make()
    ht = hetrain.init(global_batch=6, reporting=Reporting(verbose=False))
    model = tensor_parallel(make()[0])
    logit_error, grad_error = errors(model, ref, x, y)
    q = model.blocks[0].attn.q.weight
    out = {"logit_error": logit_error, "grad_error": grad_error,
           "q_local_rows": q.to_local().shape[0], "q_rows": q.shape[0],
           "fc_local_rows": model.blocks[0].mlp.fc.weight.to_local().shape[0]}
    try:   # 3 heads cannot be split as whole heads over 2 ranks
        from hetrain.demo.gpt import GPT, GPTConfig
        tensor_parallel(GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=12, n_layers=1, n_heads=3)))
        out["bad"] = "no error"
    except UsageError as e:
        out["bad"] = str(e)

    llama = tensor_parallel(make_llama())
    out["llama_errors"] = errors(llama, make_llama(), x, y)
    attn = llama.layers[0].self_attn
    out["llama_local"] = (attn.q_proj.weight.to_local().shape[0], attn.k_proj.weight.to_local().shape[0],
                          llama.layers[0].mlp.down_proj.weight.to_local().shape[1],
                          attn.num_heads, attn.num_key_value_heads)
    out["llama_replicated"] = sorted(n for n, p in llama.named_parameters() if not hasattr(p, "to_local"))
    ht.close()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(tp_worker, 2)


def test_gpt_tensor_parallel_matches_single_process(ranks):
    for r in ranks:
        assert r["logit_error"] < 1e-5, r
        assert r["grad_error"] < 1e-5, r
        assert (r["q_local_rows"], r["q_rows"], r["fc_local_rows"]) == (8, 16, 32)   # half the heads each
        assert "3 attention heads cannot be split over 2 ranks" in r["bad"]


def test_a_llama_like_model_found_by_tp_plan_matches_single_process_in_float64(ranks):
    for r in ranks:
        logit_error, grad_error = r["llama_errors"]
        assert logit_error < 1e-12 and grad_error < 1e-12, r
        # q: 2 of 4 heads (8 rows), k: 1 of 2 key/value heads (4 rows), down: 12 of 24 inputs;
        # the attention's head counts became this rank's
        assert r["llama_local"] == (8, 4, 12, 2, 1), r
        assert r["llama_replicated"] == ["embed_tokens.weight", "layers.0.input_layernorm.weight",
                                         "layers.0.post_attention_layernorm.weight",
                                         "layers.1.input_layernorm.weight",
                                         "layers.1.post_attention_layernorm.weight",
                                         "lm_head.weight", "norm.weight"], r
