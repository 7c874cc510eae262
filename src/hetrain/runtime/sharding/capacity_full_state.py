"""Checkpoints under sharding='capacity-full', in the format runtime/sharding/state.py describes:

    model   {parameter name: the whole tensor} for the sharded (trainable) parameters, and the
            module's own state_dict entries for the rest (buffers, frozen weights)
    optim   {"state": {parameter name: {key: value}}, "param_groups": [{..., "params": [names]}]},
            every element-wise value shaped like its parameter

A rank owns a contiguous slice of each segment (capacity_full.py), so a parameter may straddle
ranks. At save, a parameter owned by one rank alone is contributed by that rank as a view of its
slice (no copy); the pieces of a straddling one are reduced onto the rank owning its first element,
which contributes it whole. Every key is saved by one rank (DCP keeps plain tensors of disjoint
keys once). At load, every rank asks DCP for the whole entries of the parameters it owns a part of
now and keeps its part: whatever world size and fractions saved the checkpoint, each element lands
on the rank that owns it in this job. Collective at save (every rank walks the same slices in the
same order); local at load.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .optim_slices import check_groups, elementwise, init_optimizer_state, restore_entries, restore_groups


def _owners(seg, slot) -> list[int]:
    lo, hi = slot.offset, slot.offset + slot.numel
    found = [r for r in range(len(seg.bounds) - 1) if max(lo, seg.bounds[r]) < min(hi, seg.bounds[r + 1])]
    return found or [0]


def _overlap(seg, slot) -> tuple[int, int] | None:
    """Elements [lo, hi) of the slot's flat range this rank owns, or None."""
    a, b = seg.owned
    lo, hi = max(a, slot.offset), min(b, slot.offset + slot.numel)
    return (lo, hi) if lo < hi else None


def _other_entries(model) -> dict:
    """The module's state_dict entries that are not capacity-full's own slices (buffers, frozen weights)."""
    shards = {id(p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("capacity_full_")}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) not in shards}


def _groups(optimizer) -> list[dict]:
    segs = optimizer.sharding.segments()
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [slot.name for s in segs if s.group_index == i for slot in s.slots]}
            for i, g in enumerate(optimizer.param_groups)]


def _reduced(sharding, slot, v: torch.Tensor, part, a: int, *, owner: int) -> torch.Tensor:
    """A straddling parameter's entry whole on `owner` (a collective: every rank, its part or
    zeros). Summed on the job's device, whatever holds `v`: an offloaded optimizer's state is on
    the host, and a CUDA job's NCCL group takes no CPU tensor. The owner gets it back where `v`
    lives (host state stays on the host)."""
    t = torch.zeros(slot.numel, dtype=v.dtype, device=sharding.device)
    if part is not None:
        t[part[0] - slot.offset:part[1] - slot.offset] = v[part[0] - a:part[1] - a]
    dist.reduce(t, dst=sharding.global_rank(owner), group=sharding.group)
    return (t.to(v.device) if sharding.rank == owner else t).view(slot.shape)


def save_dicts(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts for dcp.save. A collective."""
    sharding, local = optimizer.sharding, optimizer.optim
    init_optimizer_state(local)
    model_sd = {k: v.detach() for k, v in _other_entries(model).items()}
    state = {}
    for seg in sharding.segments():
        held = local.state[seg.shard]
        keys = sorted(k for k, v in held.items() if elementwise(v, seg.shard))
        values = {"param": seg.shard.detach(), **{k: held[k] for k in keys}}
        a, _ = seg.owned
        for slot in seg.slots:
            owners, part = _owners(seg, slot), _overlap(seg, slot)
            whole = {}
            for k, v in values.items():
                if owners == [sharding.rank] and part is not None:
                    whole[k] = v[slot.offset - a:slot.offset - a + slot.numel].view(slot.shape)
                elif len(owners) > 1:
                    whole[k] = _reduced(sharding, slot, v, part, a, owner=owners[0])
                elif owners == [sharding.rank]:        # an empty parameter: rank 0 saves it
                    whole[k] = torch.zeros(slot.shape, dtype=v.dtype, device=v.device)
            if sharding.rank == owners[0]:
                model_sd[slot.name] = whole.pop("param")
                state[slot.name] = {**whole, **{k: v for k, v in held.items() if k not in keys}}
    return model_sd, {"state": state, "param_groups": _groups(optimizer)}


def load_dicts(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts for dcp.load to fill: the whole entries of every parameter
    this rank owns a part of. Local."""
    local = optimizer.optim
    init_optimizer_state(local)
    model_sd = {k: v.detach() for k, v in _other_entries(model).items()}
    state = {}
    for seg in optimizer.sharding.segments():
        held = local.state[seg.shard]
        for slot in seg.slots:
            if _overlap(seg, slot) is None:
                continue
            model_sd[slot.name] = torch.empty(slot.shape, dtype=seg.shard.dtype, device=seg.shard.device)
            state[slot.name] = {k: (torch.empty(slot.shape, dtype=v.dtype, device=v.device)
                                    if elementwise(v, seg.shard) else (v.clone() if isinstance(v, torch.Tensor) else v))
                                for k, v in held.items()}
    return model_sd, {"state": state, "param_groups": _groups(optimizer)}


@torch.no_grad()
def set_loaded(model, optimizer, *, model_sd: dict, optim_sd: dict) -> None:
    """Put what dcp.load filled (from load_dicts) into this rank's slices and their state. Local."""
    groups = check_groups(optim_sd, optimizer)
    for k, v in _other_entries(model).items():
        v.detach().copy_(model_sd[k])
    local = optimizer.optim
    for seg in optimizer.sharding.segments():
        held = local.state[seg.shard]
        a, _ = seg.owned
        for slot in seg.slots:
            part = _overlap(seg, slot)
            if part is None:
                continue
            lo, hi = part[0] - slot.offset, part[1] - slot.offset
            seg.shard.data[part[0] - a:part[1] - a] = model_sd[slot.name].reshape(-1)[lo:hi]
            restore_entries(held, optim_sd["state"][slot.name], seg.shard,
                            lambda entry, v, a=a, part=part, lo=lo, hi=hi:
                            entry[part[0] - a:part[1] - a].copy_(v.reshape(-1)[lo:hi]))
    restore_groups(optimizer, groups)
