"""Tensor parallelism for Hugging Face models, from the plan the model declares (no torch.distributed).

The plan, as the even split hands it to DTensor's `parallelize_module(model, mesh, plan)`
("colwise" = ColwiseParallel(): the weight's output rows Shard(0), the input replicated;
"rowwise" = RowwiseParallel(): the input features Shard(1), the partial outputs all-reduced),
and what the split by speed cuts instead (uneven.ShardedLinear, the same rows / columns):

    model             module (per block *)                 style     unit a rank takes whole
    GPT2LMHeadModel   transformer.h.*.attn.c_attn.q/k/v     colwise   heads (head_dim rows each)
                      transformer.h.*.attn.c_proj           rowwise   the same heads' input columns
                      transformer.h.*.mlp.c_fc              colwise   MLP columns (rows of c_fc)
                      transformer.h.*.mlp.c_proj            rowwise   the same MLP columns
    LlamaForCausalLM  model.layers.*.self_attn.q_proj       colwise   key/value groups: g query heads
                      model.layers.*.self_attn.k_proj/v_proj colwise  ... and their key/value head
                      model.layers.*.self_attn.o_proj       rowwise   the group's query-head columns
                      model.layers.*.mlp.gate_proj/up_proj  colwise   MLP columns
                      model.layers.*.mlp.down_proj          rowwise   the same MLP columns
    both              embeddings, norms, lm_head            replicated (every rank whole)

(GPT-2's c_attn, c_proj and c_fc are transformers' Conv1D, made nn.Linears first: below.)
transformers declares each model's Megatron layout in its config, as `base_model_tp_plan`: Llama's
(LlamaConfig.base_model_tp_plan) is

    "layers.*.self_attn.q_proj": "colwise",  "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",  "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",     "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",

under the base model (`base_model_prefix`: "model"). `hf_splits` reads that plan, so a Llama,
Mistral or Qwen-like model is split as transformers itself would split it, and no structure rule
is guessed. Its embeddings and the head (`lm_head`, "colwise_gather_output" in the causal LM's
own plan) stay replicated here, as for every model (layouts/tensor/shard.py); only "colwise" and
"rowwise" entries are taken, anything else (packed, MoE, sequence parallel) is refused with plan=.

How the local head count comes out right. Llama's attention views q/k/v as (..., -1, head_dim)
and repeats each key/value head `num_key_value_groups` times: a rank holding whole key/value heads
with their query heads (even or by speed: layouts/tensor/uneven.py) gets its own head count from
the -1, and the group size is unchanged, so nothing is localized (config.num_attention_heads is
read only at construction). Rotary embeddings are computed once per forward from positions and
applied per head: replicated, the same on every rank.

GPT-2 declares no plan and needs a transformation first (`gpt2_to_linears`):
  * its projections are `Conv1D`s (weight shaped (in, out): x @ W + b), which torch's
    Colwise/RowwiseParallel refuse (they take nn.Linear and nn.Embedding only); each becomes the
    nn.Linear computing the same thing (weight = Conv1D weight transposed, same bias, same name);
  * its fused `c_attn` (output [all q | all k | all v]) becomes a module `c_attn` holding three
    Linears q, k, v (the Conv1D's column blocks) whose output is their concatenation, as before;
    so its parameters are `attn.c_attn.q.weight` ... instead of `attn.c_attn.weight`, and a
    contiguous slice of each is whole heads;
  * the attention splits q/k/v with `split_size` (the whole width): that, and `num_heads`, become
    this rank's (head_attrs), since the concatenation is [local q | local k | local v].
Its plan is then declared like transformers' own (GPT2_TP_PLAN). Cross-attention is refused.
Checkpoints of a GPT-2 under TP hold these Linears' names and shapes: they resume under TP (even
or by speed, on any split), and data or pipeline parallelism refuses them (a UsageError naming
the missing entry, `attn.c_attn.weight`).

Dropout under tensor parallelism would draw different masks on different ranks for the replicated
activations (each rank's random stream has run over its own head count), so the ranks would drift
apart: a GPT-2 config with dropout is refused, naming the fix.
"""

from __future__ import annotations

import re
import sys

import torch
from torch import nn

from ....errors import UsageError
from .styles import Split

GPT2_TP_PLAN = {
    "h.*.attn.c_attn.q": "colwise", "h.*.attn.c_attn.k": "colwise", "h.*.attn.c_attn.v": "colwise",
    "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
}
_PLAN_FIX = ("pass plan= with torch's parallel styles by submodule name, e.g. "
             "{'model.layers.0.self_attn.q_proj': ColwiseParallel(), ...}")


class QKV(nn.Module):
    """GPT-2's fused c_attn as three Linears: the same output, [q | k | v]."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear):
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def is_hf(model: nn.Module) -> bool:
    """A transformers model (its classes are only looked up when transformers is already imported)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def _model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _linear_from(conv, columns: slice | None = None) -> nn.Linear:
    """The nn.Linear computing x @ W[:, columns] + b[columns] (a Conv1D's, or part of it)."""
    w, b = conv.weight.detach(), conv.bias.detach()
    if columns is not None:
        w, b = w[:, columns], b[columns]
    lin = nn.Linear(w.shape[0], w.shape[1], device="meta")    # meta: no throwaway initialisation
    lin.weight = nn.Parameter(w.t().contiguous(), requires_grad=conv.weight.requires_grad)
    lin.bias = nn.Parameter(b.clone(), requires_grad=conv.bias.requires_grad)
    return lin


def gpt2_to_linears(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Rewrite a GPT-2's Conv1Ds as nn.Linears and each c_attn as QKV, in place (see the module
    docstring); returns {old parameter name: new names} for the parameters whose names changed."""
    cfg = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise UsageError("tensor parallelism of GPT-2 with cross-attention (add_cross_attention=True) is not "
                         "supported: its q_attn and fused k/v c_attn have no declared split",
                         "use a decoder-only GPT-2, or data / pipeline parallelism")
    drops = {k: getattr(cfg, k, 0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if any(drops.values()):
        raise UsageError(f"GPT-2 with dropout ({', '.join(f'{k}={v}' for k, v in drops.items())}) under tensor "
                         "parallelism: each rank would drop different parts of the replicated activations, "
                         "and the ranks would drift apart",
                         "build it with GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)")
    from transformers.pytorch_utils import Conv1D as conv1d

    renamed: dict[str, tuple[str, ...]] = {}
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if not isinstance(child, conv1d):
                continue
            full = f"{name}.{child_name}" if name else child_name
            if child_name == "c_attn":
                d = child.weight.shape[1] // 3
                parts = [_linear_from(child, slice(i * d, (i + 1) * d)) for i in range(3)]
                setattr(m, child_name, QKV(*parts))
                for p in ("weight", "bias"):
                    renamed[f"{full}.{p}"] = tuple(f"{full}.{x}.{p}" for x in "qkv")
            else:
                setattr(m, child_name, _linear_from(child))
    return renamed


def declared_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's tensor-parallel plan with full module names' patterns, or None."""
    if _model_type(model) == "gpt2":
        plan = GPT2_TP_PLAN
    else:
        plan = getattr(model.config, "base_model_tp_plan", None)
        if not plan:
            return None
    prefix = type(model).base_model_prefix if model is not model.base_model else ""
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}


def hf_splits(model: nn.Module) -> list[Split]:
    """The Megatron pairs of a transformers model's declared plan (a GPT-2 transformed first:
    `gpt2_to_linears`), with their head counts from its config, in model order."""
    plan = declared_plan(model)
    if plan is None:
        raise UsageError(f"{type(model).__name__} declares no tensor-parallel plan (config.base_model_tp_plan)",
                         _PLAN_FIX)
    odd = sorted({v for v in plan.values() if v not in ("colwise", "rowwise")})
    if odd:
        raise UsageError(f"{type(model).__name__}'s tensor-parallel plan uses styles hetrain does not run: "
                         f"{', '.join(odd)} (only colwise and rowwise)", _PLAN_FIX)
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"(\d+)") + "$"), v) for k, v in plan.items()]
    colwise, rowwise = [], []
    for name, m in model.named_modules():
        style = next((v for rx, v in patterns if rx.match(name)), None)
        if style is None:
            continue
        if not isinstance(m, nn.Linear):
            raise UsageError(f"{name!r} is a {type(m).__name__}, not an nn.Linear: the declared plan cannot "
                             "shard it", _PLAN_FIX)
        (colwise if style == "colwise" else rowwise).append(name)
    cfg = model.config
    splits = []
    for row in rowwise:
        module = row.rpartition(".")[0]
        cols = tuple(c for c in colwise if c.startswith(module + "."))
        parent = model.get_submodule(module)
        block = re.match(r"(.*?\.\d+)(\.|$)", module)
        block = block.group(1) if block else module
        if hasattr(parent, "head_dim"):
            heads = cfg.num_attention_heads
            kv = getattr(cfg, "num_key_value_heads", None) or heads
            widths = [model.get_submodule(c).out_features for c in cols]
            if len(cols) != 3 or widths != [heads * parent.head_dim] + [kv * parent.head_dim] * 2:
                raise UsageError(f"{module!r}: the declared plan's q, k, v ({', '.join(cols)}) are {widths} wide, "
                                 f"not {heads} and {kv} heads of {parent.head_dim} (config.num_attention_heads, "
                                 "num_key_value_heads)", _PLAN_FIX)
            attrs = ()
            if _model_type(model) == "gpt2":      # it splits [q | k | v] by split_size and counts num_heads
                attrs = (("num_heads", heads), ("split_size", parent.split_size))
            splits.append(Split("attention", block, module, cols, row,
                                (("attention heads", heads), ("key/value heads", kv)), attrs))
        else:
            width = model.get_submodule(row).in_features
            if not cols or any(model.get_submodule(c).out_features != width for c in cols):
                raise UsageError(f"{module!r}: the declared plan's MLP ({', '.join(cols)} -> {row}) is not "
                                 f"Linears to and from one width {width}", _PLAN_FIX)
            splits.append(Split("mlp", block, module, cols, row, (("MLP width", width),)))
    if not splits:
        raise UsageError(f"{type(model).__name__}'s declared tensor-parallel plan matches none of its modules",
                         _PLAN_FIX)
    return splits
