"""tp_plan: the Megatron pairs found in a model's blocks by name and by structure, and every refusal
(one process, no group: the plan reads only the model's structure)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hetrain.demo.gpt import GPT, GPTConfig
from hetrain.errors import UsageError
from hetrain.runtime.layouts.tensor.shard import gpt_block_plan, tp_plan
from hetrain.runtime.layouts.tensor.styles import find_splits, localize_heads


def kinds(plan):
    """{name: 'col' | 'row'}, so plans compare by layout (styles have no equality)."""
    assert all(isinstance(s, (ColwiseParallel, RowwiseParallel)) for s in plan.values())
    return {n: "col" if isinstance(s, ColwiseParallel) else "row" for n, s in plan.items()}


class HFAttention(nn.Module):     # HF Llama's names and attributes (GQA: 4 heads, 2 key/value heads)
    def __init__(self, d=16, heads=4, kv=2):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class HFMLP(nn.Module):
    def __init__(self, d=16, h=24):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)


class HFLayer(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(16), nn.RMSNorm(16)
        self.self_attn, self.mlp = HFAttention(**kw), HFMLP()


class HFModel(nn.Module):
    def __init__(self, n=2, **kw):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 16)
        self.layers = nn.ModuleList(HFLayer(**kw) for _ in range(n))
        self.lm_head = nn.Linear(16, 10, bias=False)


def test_hf_like_layers_split_q_k_v_and_gate_up_colwise_o_and_down_rowwise():
    model = HFModel()
    got = kinds(tp_plan(model, 2))
    want = {}
    for i in range(2):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        want |= {f"{a}.q_proj": "col", f"{a}.k_proj": "col", f"{a}.v_proj": "col", f"{a}.o_proj": "row",
                 f"{m}.gate_proj": "col", f"{m}.up_proj": "col", f"{m}.down_proj": "row"}
    assert got == want      # embeddings, norms and the head stay replicated
    # the module views heads as (num_heads, head_dim): each rank's count becomes its own
    splits = find_splits(model)
    localize_heads(model, splits, 2)
    attn = model.layers[1].self_attn
    assert (attn.num_heads, attn.num_key_value_heads, attn.head_dim) == (2, 1, 4)


def test_demo_gpt_gets_its_block_plan_and_keeps_its_global_head_count():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4))
    want = {f"blocks.{i}.{n}": k for i in range(2) for n, k in kinds(gpt_block_plan()).items()}
    assert kinds(tp_plan(model, 4)) == want
    localize_heads(model, find_splits(model), 4)
    # the GPT derives the head width as d_model // n_heads (and views with -1): n_heads stays whole
    assert model.blocks[0].attn.n_heads == 4


class Unnamed(nn.Module):
    """Attention and MLP whose Linears have no recognised names: found by the structural rule."""

    def __init__(self, d=8):
        super().__init__()
        self.mix = nn.Module()
        self.mix.n_head = 2
        self.mix.a, self.mix.b, self.mix.c, self.mix.d = (nn.Linear(d, d) for _ in range(4))
        self.ff = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, d))
        self.norm_ff = nn.Sequential(nn.Linear(d, 32), nn.LayerNorm(32), nn.Linear(32, d))   # not elementwise


def test_unnamed_attention_and_mlp_are_found_by_structure_and_a_norm_between_is_not_split():
    model = nn.Sequential(Unnamed(), Unnamed())
    got = kinds(tp_plan(model, 2))
    assert got == {f"{i}.{n}": k for i in range(2) for n, k in
                   {"mix.a": "col", "mix.b": "col", "mix.c": "col", "mix.d": "row",
                    "ff.0": "col", "ff.3": "row"}.items()}


class NanoAttention(nn.Module):   # nanoGPT: one fused c_attn Linear(d, 3d)
    def __init__(self, d=16):
        super().__init__()
        self.n_head = 4
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)


class NanoBlock(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(16), attn, nn.LayerNorm(16)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(16, 64), nn.Linear(64, 16)


class FusedUnnamed(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads = 4
        self.inp, self.outp = nn.Linear(16, 48), nn.Linear(16, 16)


@pytest.mark.parametrize("attn, name", [(NanoAttention(), "h.0.attn.c_attn"),
                                        (FusedUnnamed(), "h.0.attn.inp"),
                                        (nn.MultiheadAttention(16, 4), "h.0.attn.in_proj_weight")])
def test_a_fused_qkv_projection_is_refused_with_plan_as_the_fix(attn, name):
    model = nn.Module()
    model.h = nn.ModuleList([NanoBlock(attn)])
    with pytest.raises(UsageError) as e:
        tp_plan(model, 2)
    assert f"{name!r} computes q, k and v in one fused projection" in e.value.what
    assert "not whole heads of q, k and v" in e.value.what and "plan=" in e.value.fix


def test_a_fused_gate_up_projection_is_refused():
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = nn.Linear(16, 48), nn.Linear(24, 16)
    with pytest.raises(UsageError) as e:
        tp_plan(nn.ModuleList([mlp]), 2)
    assert "'0.gate_up_proj' computes gate and up in one fused projection" in e.value.what
    assert "not matching features of gate and up" in e.value.what


def test_heads_that_do_not_divide_name_the_block_and_the_sizes_that_work():
    with pytest.raises(UsageError) as e:
        tp_plan(HFModel(heads=4, kv=2), 4)        # 2 key/value heads over 4 ranks
    assert e.value.what == ("block 'layers.0' (layers.0.self_attn): 2 key/value heads cannot be split "
                            "over 4 ranks as whole heads")
    assert "divides every count: 2 " in e.value.fix      # gcd(4 heads, 2 kv heads, 24 MLP width) = 2
    gpt = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=12, n_layers=1, n_heads=3))
    with pytest.raises(UsageError, match="3 attention heads cannot be split over 2 ranks") as e:
        tp_plan(gpt, 2)
    assert "divides every count: 3 " in e.value.fix and "more heads" in e.value.fix


def test_an_mlp_width_that_does_not_divide_is_named():
    block = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    with pytest.raises(UsageError) as e:
        tp_plan(nn.ModuleList([block]), 8)
    assert e.value.what == "block '0': MLP width 12 does not divide over 8 ranks"
    assert "divides every count: 2, 3, 4, 6, 12 " in e.value.fix


def test_a_model_without_blocks_or_without_anything_to_split_says_what_was_looked_for():
    with pytest.raises(UsageError) as e:
        tp_plan(nn.Linear(4, 4), 2)
    assert "looks for an nn.ModuleList of blocks" in e.value.what and "plan=" in e.value.fix
    with pytest.raises(UsageError) as e:
        tp_plan(nn.ModuleList([nn.Conv1d(3, 3, 1), nn.Conv1d(3, 3, 1)]), 2)
    assert "found 2 blocks" in e.value.what and "q_proj" in e.value.what and "down_proj" in e.value.what
    assert "plan=" in e.value.fix


def test_attention_without_an_output_projection_or_a_head_count_is_refused():
    attn = HFAttention()
    del attn.o_proj
    with pytest.raises(UsageError, match="no output projection"):
        tp_plan(nn.ModuleList([attn]), 2)
    attn = HFAttention()
    del attn.num_heads, attn.head_dim
    with pytest.raises(UsageError, match="cannot tell how many heads"):
        tp_plan(nn.ModuleList([attn]), 2)
    attn = HFAttention()
    del attn.num_heads            # HF's newer attention: head_dim only, the count from q's width
    assert len(tp_plan(nn.ModuleList([attn]), 2)) == 4
    attn.num_heads = 3            # 16 q features are not 3 whole heads
    with pytest.raises(UsageError, match="not whole heads of one width"):
        tp_plan(nn.ModuleList([attn]), 2)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_the_size_must_be_a_whole_number(size):
    with pytest.raises(UsageError, match="whole number"):
        tp_plan(HFModel(), size)
