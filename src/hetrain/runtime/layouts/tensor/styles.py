"""What tensor parallelism splits in a transformer-like model, found by structure (no torch.distributed).

`tp_plan(model, size)` returns torch's parallel styles by submodule name, the Megatron layout:
every pair of a column-parallel Linear (each rank computes a slice of its output features) feeding
a row-parallel one (each rank multiplies its slice of the input features; the partial sums are
all-reduced back to a replicated output). The rule:

  * Blocks: the members of the model's outermost nn.ModuleLists (`find_blocks`, as activation
    checkpointing finds them), or the children of an nn.Sequential.
  * In a block, every module (the block itself included) is read by its direct Linear children:
    - attention: three Linears named as q / k / v (q, q_proj, query, wq), each `ColwiseParallel`,
      and its output projection (proj, o_proj, out_proj, c_proj, dense, wo) `RowwiseParallel`.
      Unnamed: a module with a head-count attribute and four Linears, in definition order q, k, v
      from the width d, then the output projection from q's width back to d.
    - MLP: the up / gate Linears (fc, c_fc, fc1, up_proj, gate_proj, w1, w3) `ColwiseParallel`
      and the down one (proj, c_proj, fc2, down_proj, w2) `RowwiseParallel`, shaped d -> h, h -> d.
      Unnamed: a module whose Linears are one or more d -> h and one h -> d (h != d) and whose
      other children hold no parameters (activations, dropout: elementwise, so each rank applies
      them to its own slice of h; a norm over h would need the whole of it).
  * A fused q/k/v Linear (qkv, c_attn, Wqkv, query_key_value; nn.MultiheadAttention; unnamed: a
    module with a head count and two Linears, d -> more than d, then back to d)
    or gate/up Linear (gate_up_proj) is refused: its output rows are [all q | all k | all v], so a
    contiguous slice is not whole heads of each.
  * Whole heads: the attention module's head count (n_heads, num_heads, n_head,
    num_attention_heads; else its config.num_attention_heads; else q's width / head_dim) and its
    key/value head count (from k's width) must divide by `size`, and so must every MLP width.
Everything else (embeddings, norms, heads) stays replicated, computed identically on every rank.

The checks read only the model's structure, so every rank (same model, same size) raises the same
UsageError before any collective: none is left waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ....errors import UsageError
from ...user_objects import find_blocks

Q, K, V = ("q", "q_proj", "query", "wq"), ("k", "k_proj", "key", "wk"), ("v", "v_proj", "value", "wv")
OUT = ("proj", "o_proj", "out_proj", "c_proj", "dense", "wo")
UP = ("fc", "c_fc", "fc1", "up_proj", "gate_proj", "w1", "w3")
DOWN = ("proj", "c_proj", "fc2", "down_proj", "w2")
FUSED = ("qkv", "c_attn", "Wqkv", "query_key_value", "qkv_proj", "gate_up_proj")
HEADS = ("n_heads", "num_heads", "n_head", "num_attention_heads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
HEAD_WIDTH = ("head_dim", "head_size", "d_head", "attention_head_size")


@dataclass(frozen=True)
class Split:
    """One Megatron pair in a block: `colwise` Linears feeding the `rowwise` one (full names)."""

    kind: str                                  # "attention" | "mlp"
    block: str
    module: str
    colwise: tuple[str, ...]
    rowwise: str
    counts: tuple[tuple[str, int], ...]        # what must divide by the size: ("attention heads", 4), ...
    head_attrs: tuple[tuple[str, int], ...] = ()   # head-count attributes to make local, with their totals


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def _one(linears: dict[str, nn.Linear], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in linears), None)


def _int_attr(obj, names: tuple[str, ...]) -> tuple[str, int] | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return n, v
    return None


def _refuse_fused(block: str, name: str, what: str) -> None:
    parts = "whole heads of q, k and v" if what == "q, k and v" else f"matching features of {what}"
    raise UsageError(
        f"block {block!r}: {name!r} computes {what} in one fused projection, whose output rows are "
        f"[all of one | all of the next | ...]: a contiguous slice per rank is not {parts}, "
        "so tensor parallelism cannot split it column-wise",
        "split it into separate Linears (one per q, k, v or gate, up; copy the weight's row blocks), or pass "
        "plan= with parallel styles by submodule name for the parts to shard, leaving this one replicated")


def _attention(block: str, name: str, m: nn.Module, linears: dict[str, nn.Linear]) -> Split | None:
    full = _join(block, name)
    q, k, v = _one(linears, Q), _one(linears, K), _one(linears, V)
    heads = _int_attr(m, HEADS)
    if q and k and v:
        out = _one(linears, OUT)
        if out is None:
            raise UsageError(
                f"block {block!r}: attention {full!r} has q/k/v projections ({q}, {k}, {v}) but no output "
                f"projection among its Linears (looked for {', '.join(OUT)})",
                "pass plan= with the output projection as RowwiseParallel(), or name it o_proj")
    elif heads is not None and len(linears) == 4:
        # unnamed: in definition order, q, k, v from the width d, then the output back to d
        q, k, v, out = linears
        d = linears[out].out_features
        if any(linears[p].in_features != d for p in (q, k, v)) or linears[out].in_features != linears[q].out_features:
            return None
    elif heads is not None and len(linears) == 2:
        first, second = linears.values()
        if first.in_features == second.out_features and first.out_features > second.in_features:
            _refuse_fused(block, _join(full, next(iter(linears))), "q, k and v")   # d -> (q|k|v), q -> d
        return None
    else:
        return None
    width = _int_attr(m, HEAD_WIDTH)
    if heads is None:
        config_heads = getattr(getattr(m, "config", None), "num_attention_heads", None)
        if isinstance(config_heads, int) and config_heads > 0:
            heads = ("config.num_attention_heads", config_heads)
        elif width is not None and linears[q].out_features % width[1] == 0:
            heads = (f"q's width / {width[0]}", linears[q].out_features // width[1])
        else:
            raise UsageError(
                f"block {block!r}: cannot tell how many heads attention {full!r} has (looked for the attributes "
                f"{', '.join(HEADS)}, config.num_attention_heads, and {', '.join(HEAD_WIDTH)})",
                "give the module an n_heads attribute, or pass plan= with its parallel styles")
    n = heads[1]
    q_width, kv_width = linears[q].out_features, linears[k].out_features
    if q_width % n or kv_width % (q_width // n) or linears[v].out_features != kv_width:
        raise UsageError(
            f"block {block!r}: attention {full!r} has {n} heads ({heads[0]}), but q has {q_width} output features "
            f"and k, v {kv_width}, {linears[v].out_features}: they are not whole heads of one width",
            "fix the head-count attribute, or pass plan= with its parallel styles")
    kv = kv_width // (q_width // n)
    # The module views its q/k/v output as (..., heads, head width). Where it keeps the head width
    # as an attribute (HF's head_dim), it views (count, head_dim) and each rank must view only its
    # own heads: the count attributes become the local count, as torch's TP tutorial does
    # (`attn.n_heads //= size`). Where it derives the width from the count and the (replicated)
    # model width, as the demo GPT does (d_model // n_heads, with -1 for the count), the count
    # must stay the whole model's, so nothing is changed.
    attrs = ()
    if width is not None:
        attrs = tuple(a for a in (_int_attr(m, HEADS), _int_attr(m, KV_HEADS)) if a is not None)
    return Split("attention", block, full, tuple(_join(full, p) for p in (q, k, v)), _join(full, out),
                 (("attention heads", n), ("key/value heads", kv)), attrs)


def _mlp(block: str, name: str, m: nn.Module, linears: dict[str, nn.Linear]) -> Split | None:
    ups, down = [n for n in UP if n in linears], _one(linears, DOWN)
    named = bool(ups and down)
    if not named:
        # unnamed: d -> h ... h -> d with only parameter-free (elementwise) children besides
        holds = any(True for c in m.children() if not isinstance(c, nn.Linear) for _ in c.parameters())
        if len(linears) < 2 or holds or any(True for _ in m.parameters(recurse=False)):
            return None
        *ups, down = list(linears)
    d, h = linears[down].out_features, linears[down].in_features
    if (h == d and not named) or any(linears[u].in_features != d or linears[u].out_features != h for u in ups):
        return None
    full = _join(block, name)
    return Split("mlp", block, full, tuple(_join(full, u) for u in ups), _join(full, down), (("MLP width", h),))


def find_splits(model: nn.Module) -> list[Split]:
    """Every attention and MLP pair of `model`'s blocks (see the module docstring), in model order."""
    blocks = find_blocks(model)
    if not blocks and isinstance(model, nn.Sequential):
        blocks = list(model.named_children())
    if not blocks:
        raise UsageError(
            f"cannot find the blocks of a {type(model).__name__} to shard: tensor parallelism looks for an "
            "nn.ModuleList of blocks (or the children of an nn.Sequential)",
            "keep the model's repeated blocks in an nn.ModuleList, or pass plan= with the parallel styles by "
            "submodule name, e.g. {'layers.0.attn.q_proj': ColwiseParallel(), ...}")
    splits = []
    for block_name, block in blocks:
        taken: list[str] = []
        for name, m in block.named_modules():
            if any(name == t or name.startswith(t + ".") for t in taken):
                continue
            if isinstance(m, nn.MultiheadAttention):
                _refuse_fused(block_name, _join(block_name, name, "in_proj_weight"), "q, k and v")
            fused = next((n for n, c in m.named_children() if n in FUSED and any(True for _ in c.parameters())), None)
            if fused is not None:
                _refuse_fused(block_name, _join(block_name, name, fused),
                              "gate and up" if fused == "gate_up_proj" else "q, k and v")
            linears = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}
            found = _attention(block_name, name, m, linears) or _mlp(block_name, name, m, linears)
            if found is not None:
                splits.append(found)
                if name:
                    taken.append(name)
    if not splits:
        raise UsageError(
            f"found {len(blocks)} block{'s' * (len(blocks) != 1)} in a {type(model).__name__} "
            f"(first: {blocks[0][0]!r}) but no attention "
            f"(Linears named {'/'.join(Q)}, {'/'.join(K)}, {'/'.join(V)} + {'/'.join(OUT)}) or MLP "
            f"({'/'.join(UP)} + {'/'.join(DOWN)}, or Linear(d, h) -> activation -> Linear(h, d)) in them",
            "pass plan= with the parallel styles by submodule name, e.g. {'layers.0.ff.in': ColwiseParallel(), "
            "'layers.0.ff.out': RowwiseParallel()}")
    return splits


def check_size(splits: list[Split], size: int) -> None:
    """A UsageError naming the first block whose heads or widths do not divide by `size`, and the
    sizes that divide every count of the model."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise UsageError(f"the tensor-parallel size must be a whole number >= 1, got {size!r}",
                         "pass the number of ranks that share each layer, e.g. 2")
    common = math.gcd(*(n for s in splits for _, n in s.counts))
    works = [str(d) for d in range(2, common + 1) if common % d == 0]
    fix = (f"use a tensor-parallel size that divides every count: {', '.join(works)} "
           "(the size of the mesh passed, or of the job)" if works else
           "no size above 1 divides every count of this model: use data or pipeline parallelism")
    for s in splits:
        for what, n in s.counts:
            if n % size:
                where = f"block {s.block!r}" + ("" if s.module == s.block else f" ({s.module})")
                if what == "MLP width":
                    raise UsageError(f"{where}: MLP width {n} does not divide over {size} ranks", fix)
                raise UsageError(f"{where}: {n} {what} cannot be split over {size} ranks as whole heads",
                                 fix + ", or a model with more heads")


def styles(splits: list[Split]) -> dict[str, ParallelStyle]:
    """The Megatron pairs as torch's parallel styles, by submodule name."""
    plan: dict[str, ParallelStyle] = {}
    for s in splits:
        plan.update({c: ColwiseParallel() for c in s.colwise})
        plan[s.rowwise] = RowwiseParallel()
    return plan


def tp_plan(model: nn.Module, size: int) -> dict[str, ParallelStyle]:
    """The parallel styles for `model`'s blocks over `size` ranks, by submodule name (see the module
    docstring for the rule), or a UsageError saying why not and what to try."""
    splits = find_splits(model)
    check_size(splits, size)
    return styles(splits)


def localize_heads(model: nn.Module, splits: list[Split], size: int) -> None:
    """Set the head-count attributes that attention modules view heads with to this rank's count
    (see `_attention`); call once, after the model is sharded."""
    modules = dict(model.named_modules())
    for s in splits:
        for attr, total in s.head_attrs:
            setattr(modules[s.module], attr, total // size)
