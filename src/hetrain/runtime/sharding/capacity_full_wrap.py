"""sharding='capacity-full' set up: units, fractions agreed by every rank, the fit check, the
optimizer over the owned slices and the device hooks' meter (the mechanics: capacity_full.py).

Fractions. A rank's usable memory less what it holds beyond its shards (its activations, buffers,
frozen weights and the gathered units: planning/memory.full_shard_transient) is its *free*
memory; f_r = free_r / Σ free fills every device to the same fraction. The sharded state S
(trainable parameters, gradients, optimizer values) fits when S <= Σ free; when it does not, every
rank raises the same UsageError, with every rank's figures and the bytes missing on each (decided
from one all_gather of the figures: no rank goes on alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UsageError
from ...hardware.units import format_bytes
from ...planning.memory import capacity_fractions, full_shard_transient, partition_bounds, state_values
from .capacity import ELEMENTWISE, constructor_defaults, state_tensors
from .capacity_full import FullSharding, Segment, Slot, Unit


class FullShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer class over this rank's slices. `param_groups` hold the slices (an LR
    scheduler works as usual); `optim`, the same class over the same slices, follows their
    hyperparameters at every step. Its state exists for the slices alone."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: FullSharding):
        self.sharding = sharding
        segs = sharding.segments()
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [s.shard for s in segs if s.group_index == i]} for i, g in enumerate(optimizer.param_groups)]
        if not any(g["params"] for g in groups):       # torch refuses an optimizer over nothing
            groups[0]["params"] = [nn.Parameter(torch.zeros(0))]
        super().__init__(groups, optimizer.defaults)
        self.optim = type(optimizer)([dict(g) for g in self.param_groups], **constructor_defaults(optimizer))

    def held_tensors(self) -> list[torch.Tensor]:
        """The optimizer state this rank holds (its slices' parameters and gradients are the model's);
        an `optim` that names its own (offloaded to the host: memory/offload.py) is asked."""
        held = getattr(self.optim, "held_tensors", None)
        return held() if callable(held) else state_tensors(self.optim)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sharding.wait_reduces()
        for shard in self.sharding.shards():
            shard.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UsageError("sharding='capacity-full' does not take an optimizer closure",
                             "call step() without a closure (hetrain's ht.step() does)")
        self.sharding.wait_reduces()
        for mine, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in mine.items() if k != "params"})   # LR schedulers change these
        self.optim.step()

    def state_dict(self):
        raise UsageError("a capacity-full optimizer's state is split over the ranks: it has no state_dict of its own",
                         "checkpoint with hetrain.init(checkpoints=Checkpoints(dir=...)), which saves every rank's slices")

    def load_state_dict(self, state_dict):
        raise UsageError("a capacity-full optimizer's state is split over the ranks: it has no "
                         "load_state_dict of its own",
                         "resume with hetrain.init(checkpoints=Checkpoints(dir=...)), which loads every rank's slices")


class FullSync:
    """What the loop drives: no_sync() on a rank's non-last micro-batches, reset() after an agreed
    redo, clip_grad_norm() at the step (the layout's clip asks for it)."""

    guard = None

    def __init__(self, sharding: FullSharding):
        self.sharding = sharding

    def no_sync(self):
        return self.sharding.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.sharding.clip_grad_norm(max_norm)

    def reset(self) -> None:
        sharding = self.sharding
        with contextlib.suppress(RuntimeError):
            sharding.wait_reduces()
        for unit in sharding.order:
            if unit.gathered:
                sharding.release(unit)
            unit.in_backward = False
            for seg in unit.segments:
                seg.acc = None
        sharding.applied = sharding.reduced = 0


# -- building it -------------------------------------------------------------------------------------
def shard_fully(model: nn.Module, optimizer: torch.optim.Optimizer, *, rank: int, world_size: int,
                blocks: Sequence[nn.Module], free_bytes: float | None, accumulates: bool = False,
                meter=None, labels: Sequence[str] | None = None, optimizer_kind: str | None = None,
                group=None) -> tuple[FullSharding, FullShardedOptimizer, list[str]]:
    """Shard `model` in place (a collective: every rank, the same model and optimizer). `free_bytes`:
    this rank's memory for model state beyond its parameters and gradients as the wrapper reckons
    it (sharding/wrap.py: usable − the unsharded parameters and gradients − activations; None:
    unknown, even split). Returns the sharding, the optimizer to step, and what was done."""
    if not isinstance(optimizer, ELEMENTWISE):
        raise UsageError(f"sharding='capacity-full' splits parameters into flat slices; {type(optimizer).__name__} "
                         "may use per-tensor statistics, which slices would change",
                         "use an element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad...), or sharding='fsdp'")
    if optimizer.state:
        raise UsageError("sharding='capacity-full' needs a fresh optimizer (it has state already)",
                         "pass the optimizer to prepare() before any optimizer step")
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    names, places = _names_and_places(model)
    trainable = [p for p in names.values() if p.requires_grad]
    lost = [n for n, p in names.items() if p.requires_grad and id(p) not in group_of]
    if lost:
        raise UsageError(f"sharding='capacity-full': parameter(s) {lost[:3]} require grad but are in no optimizer "
                         "param group", "pass every trainable parameter to the optimizer, or set requires_grad=False")
    unit_params = _assign(model, blocks, trainable)
    element = trainable[0].element_size() if trainable else 4
    root_n = sum(p.numel() for p in unit_params[0])
    block_n = [sum(p.numel() for p in ps) for ps in unit_params[1:]]
    n_train = root_n + sum(block_n)
    transient = full_shard_transient(block_n, root_n, param_bytes=element, accumulates=accumulates, trainable=n_train)
    per_param = 2 * element + state_values(optimizer_kind or "sgd") * element
    fractions, why = _agree_fractions(free_bytes, transient, n_train * element, n_train * per_param,
                                      rank=rank, world_size=world_size, labels=labels)
    by_name = {id(p): n for n, p in names.items()}
    units = []
    for i, params in enumerate(unit_params):
        segments = []
        for gi in sorted({group_of[id(p)] for p in params}):
            ps = [p for p in params if group_of[id(p)] == gi]
            if len({p.dtype for p in ps}) > 1 or len({p.device for p in ps}) > 1:
                raise UsageError("sharding='capacity-full' needs one dtype and device per block and param group",
                                 "put parameters of different dtypes in different optimizer param groups")
            offsets, slots = 0, []
            for p in ps:
                slots.append(Slot(by_name[id(p)], tuple(places[id(p)]), p.shape, offsets))
                offsets += p.numel()
            segments.append(Segment(slots, ps, partition_bounds(offsets, fractions), rank=rank, group_index=gi))
        units.append(Unit("root" if i == 0 else f"block {i - 1}", segments))
    for p in trainable:                    # the whole parameters leave the modules (and free their memory)
        for module, attr in places[id(p)]:
            delattr(module, attr)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    owners = [model] + list(blocks)
    for module, unit in zip(owners, units):
        for k, seg in enumerate(unit.segments):
            module.register_parameter(f"capacity_full_{'root_' if module is model else ''}shard{k}", seg.shard)
    root = units[0] if units[0].segments else None
    sharding = FullSharding(model, root, [(m, u) for m, u in zip(blocks, units[1:]) if u.segments],
                            rank=rank, world_size=world_size, fractions=fractions, group=group)
    opt = FullShardedOptimizer(optimizer, sharding)
    if meter is not None:
        meter.transient = int(transient)
        meter.saved_is_state = sharding.is_gathered_storage
    owned = sum(s.shard.numel() for s in sharding.segments())
    lines = ["sharding=capacity-full: parameters, gradients and optimizer state split "
             + " / ".join(f"{f:.0%}" for f in fractions) + f" ({why}) over {len(sharding.order)} unit(s); "
             f"this rank owns {owned:,} of {n_train:,} trainable elements, gathers at most "
             f"{format_bytes(transient)} at a time"]
    return sharding, opt, lines


def _names_and_places(model: nn.Module):
    names = dict(model.named_parameters())
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((module, attr))
    return names, places


def _assign(model: nn.Module, blocks: Sequence[nn.Module], trainable) -> list[list[nn.Parameter]]:
    """[root's, block 0's, ...] trainable parameters, in model order; a parameter shared between
    a block and anything else goes to the root (it is then gathered whenever the root is)."""
    homes: dict[int, set[int]] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            homes.setdefault(id(p), set()).add(i)
    inside = {id(p) for b in blocks for p in b.parameters()}
    units: list[list[nn.Parameter]] = [[] for _ in range(len(blocks) + 1)]
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    outside_users = {id(p) for m in model.modules() if id(m) not in in_blocks
                     for _, p in m.named_parameters(recurse=False)}
    for p in trainable:
        h = homes.get(id(p), set())
        if id(p) in inside and len(h) == 1 and id(p) not in outside_users:
            units[1 + next(iter(h))].append(p)
        else:
            units[0].append(p)
    return units


def _agree_fractions(free_bytes, transient, param_bytes, sharded_bytes, *, rank, world_size, labels):
    """(fractions, why), the same on every rank (from one all_gather); raises on every rank alike
    when the sharded state does not fit the free memory of all ranks together."""
    mine = None if free_bytes is None else (float(free_bytes) + 2 * param_bytes, float(transient))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if any(e is None for e in everyone):
        return tuple(1.0 / world_size for _ in range(world_size)), "free memory unknown on some device: even split"
    free = [room - t for room, t in everyone]
    labels = list(labels) if labels else [f"rank {r}" for r in range(world_size)]
    if sharded_bytes > sum(max(0.0, f) for f in free) or any(f < 0 for f in free):
        fits = capacity_fractions([max(f, 0.0) for f in free]) if any(f > 0 for f in free) else None
        rows = []
        for r, ((room, t), f) in enumerate(zip(everyone, free)):
            share = fits[r] * sharded_bytes if fits else 0.0
            rows.append(f"{labels[r]}: its share {format_bytes(share)} + gathered units "
                        f"{format_bytes(t)} of {format_bytes(room)} usable: missing "
                        f"{format_bytes(max(0.0, share + t - room))} ({max(0.0, share + t - room):,.0f} B)")
        raise UsageError(
            f"the model does not fit even fully sharded (sharding='capacity-full'): {format_bytes(sharded_bytes)} "
            f"of parameters, gradients and optimizer state against {format_bytes(sum(max(0.0, f) for f in free))} "
            "free over all devices; " + "; ".join(rows),
            "use activation checkpointing, smaller micro-batches, a smaller model, or more devices")
    fractions = capacity_fractions(free)
    return fractions, "in proportion to free memory " + " : ".join(format_bytes(f) for f in free)
