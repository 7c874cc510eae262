"""Moving blocks between pipeline stages at a step boundary (an online re-split: the decision is
runtime/layouts/pipeline/resplit.py's): the parameters, buffers and optimizer state of every block that
changes stage travel from the rank that trained them to the rank that trains them next, and the
optimizer steps over the new stage's parameters from then on. Nothing is recomputed or reset: the
moment estimates and step counts an AdamW kept for a block are the ones the new owner continues.

Every rank of the pipeline enters `move_blocks` at the same boundary, with the split the step's
agreement table gave every rank. First comes one all_gather_object of each rank's proposed split,
its plan version and what it will send (each tensor's optimizer-state keys, shapes and dtypes, so
that a receiver can allocate them before anything arrives): if the ranks do not all propose the
same split, which would be a bug, every rank sees it in the same gathered list and all keep the
old split. Then the tensors travel, flattened into one buffer per (sender, receiver, dtype), by
isend/irecv posted all at once and then waited for: no pair waits on another, so no rank hangs.

What moves is decided per tensor, not per block: a tensor is held by every stage whose module holds
it (a weight tied between the first and last parts by both), goes to each new holder from its
lowest old holder, and an old holder that no longer holds it drops its optimizer state (and keeps
the stale values, which it never uses again unless the tensor comes back, fresh, with a later move).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .blocks import PipelineParts, StageModule


def canonical_tensors(parts: PipelineParts) -> list[torch.Tensor]:
    """Every parameter and buffer of the model's parts, each once, in the same order on every rank
    (every rank builds the same model): a tensor is named by its place in this list."""
    whole = StageModule(parts, 0, len(parts.blocks), is_first=True, is_last=True)
    seen: set[int] = set()
    out = []
    for t in (*whole.parameters(), *whole.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def holdings(parts: PipelineParts, bounds: Sequence[tuple[int, int]], index: dict[int, int]) -> list[set[int]]:
    """The tensors (places in canonical_tensors) each stage's module holds under `bounds`."""
    p = len(bounds)
    held = []
    for s, (a, b) in enumerate(bounds):
        module = StageModule(parts, a, b, is_first=s == 0, is_last=s == p - 1)
        held.append({index[id(t)] for t in (*module.parameters(), *module.buffers())})
    return held


def plan_moves(old: Sequence[set[int]], new: Sequence[set[int]]):
    """([(tensor, from stage, to stage)], [(tensor, stage that lets it go)]): every new holder of a
    tensor gets it from its lowest old holder."""
    sends, drops = [], []
    for i in sorted(set().union(*old, *new)):
        had = [s for s, h in enumerate(old) if i in h]
        has = [s for s, h in enumerate(new) if i in h]
        sends += [(i, had[0], s) for s in has if s not in had]
        drops += [(i, s) for s in had if s not in has]
    return sends, drops


def _describe(state: dict, param: torch.Tensor) -> list[tuple]:
    """An optimizer state entry as a receiver needs it to allocate: tensors by shape, dtype and
    whether they live beside the parameter (AdamW keeps `step` on the CPU), other values as they are."""
    out = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out.append((key, "tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."),
                        value.device == param.device))
        else:
            out.append((key, "value", value))
    return out


def move_blocks(*, parts: PipelineParts, old_bounds, new_bounds, stage: int, ranks: Sequence[int],
                optimizer: torch.optim.Optimizer, device: torch.device, names: dict[int, str],
                group_names: Sequence[Sequence[str]], version: int, sizes: Sequence[int], group=None) -> str | None:
    """Collective of the pipeline (`ranks`: its global ranks by stage; `group`: its process group,
    None for the whole job). Moves every tensor that changes holder and points the optimizer's
    param groups at this stage's new parameters (in the user's order, by whole-model name).
    Returns None once moved, or why nothing moved (the same on every rank)."""
    tensors = canonical_tensors(parts)
    index = {id(t): i for i, t in enumerate(tensors)}
    sends, drops = plan_moves(holdings(parts, old_bounds, index), holdings(parts, new_bounds, index))
    state = optimizer.state
    outgoing = {i: (_describe(state[tensors[i]], tensors[i]) if tensors[i] in state else [])
                for i, src, _ in sends if src == stage}
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, {"sizes": list(sizes), "version": version, "meta": outgoing}, group=group)
    proposals = {(tuple(g["sizes"]), g["version"]) for g in gathered}
    if len(proposals) != 1:
        return ("the ranks proposed different splits (" + "; ".join(
            f"rank {r}: {'/'.join(map(str, g['sizes']))} at plan v{g['version']}" for r, g in zip(ranks, gathered))
            + "): this is a bug in hetrain; please report it with the log")
    meta = {i: m for g in gathered for i, m in g["meta"].items()}
    received = _transfer(sends, stage, ranks, tensors, meta, state, device, group)
    mine = holdings(parts, new_bounds, index)[stage]
    for i, s in drops:
        if s == stage:
            state.pop(tensors[i], None)
            tensors[i].grad = None
    with torch.no_grad():
        for i, (value, entry) in received.items():
            tensors[i].copy_(value)
            if entry:
                state[tensors[i]] = entry
    by_name = {names.get(id(t)): i for i, t in enumerate(tensors)}
    for g, whole in zip(optimizer.param_groups, group_names):
        g["params"] = [tensors[by_name[n]] for n in whole if n in by_name and by_name[n] in mine]
    return None


def _transfer(sends, stage: int, ranks, tensors, meta: dict, state, device: torch.device, group) -> dict:
    """Post every send and receive of this rank, wait for all, and return what arrived:
    {tensor: (its values, its optimizer state entry)}."""
    works, unpack, arrived = [], [], []
    for pair in sorted({(src, dst) for _, src, dst in sends if stage in (src, dst)}):
        items = [i for i, src, dst in sends if (src, dst) == pair]
        sending = pair[0] == stage
        pieces = [t for i in items for t in (_outgoing_tensors(tensors[i], state, meta[i], device) if sending
                                             else _incoming_tensors(tensors[i], meta[i], device))]
        by_dtype: dict[str, list[torch.Tensor]] = {}
        for t in pieces:
            by_dtype.setdefault(str(t.dtype), []).append(t)
        for dtype in sorted(by_dtype):      # the same order on both sides of the pair
            flat = _flatten_dense_tensors(by_dtype[dtype])
            if sending:
                works.append(dist.isend(flat, dst=ranks[pair[1]], group=group))
            else:
                works.append(dist.irecv(flat, src=ranks[pair[0]], group=group))
                unpack.append((flat, by_dtype[dtype]))
        if not sending:
            arrived.append((items, pieces))
    for work in works:
        work.wait()
    for flat, templates in unpack:
        for t, v in zip(templates, _unflatten_dense_tensors(flat, templates)):
            t.copy_(v)
    received = {}
    for items, pieces in arrived:
        received.update(_assemble(items, pieces, meta))
    return received


def _outgoing_tensors(param: torch.Tensor, state, entries: list, device: torch.device) -> list[torch.Tensor]:
    held = state[param] if param in state else {}
    return [param.detach().to(device)] + [held[key].detach().to(device) for key, kind, *_ in entries
                                          if kind == "tensor"]


def _incoming_tensors(param: torch.Tensor, entries: list, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(param.shape, dtype=param.dtype, device=device)] + [
        torch.empty(e[2], dtype=getattr(torch, e[3]), device=device) for e in entries if e[1] == "tensor"]


def _assemble(items, pieces, meta: dict) -> dict:
    """The received buffers as each tensor's values and optimizer state entry, the state placed
    where the sender kept it: beside the parameter (on this stage's device), or on the CPU."""
    out, at = {}, 0
    for i in items:
        value, at = pieces[at], at + 1
        entry = {}
        for e in meta[i]:
            if e[1] == "tensor":
                entry[e[0]] = pieces[at] if e[4] else pieces[at].cpu()
                at += 1
            else:
                entry[e[0]] = e[2]
        out[i] = (value, entry)
    return out
