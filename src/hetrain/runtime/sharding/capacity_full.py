"""Capacity-proportional full sharding (sharding='capacity-full'): parameters, gradients and
optimizer state split over the ranks in proportion to each device's free memory.

FSDP2 (and ZeRO-3) shard every unit evenly, so the smallest card caps the model at W times what
it holds. Here a *unit* (each block of the model, plus the root: what is left, embeddings and head)
keeps its trainable parameters as one flat buffer per optimizer param group (a *segment*), and rank
r owns the contiguous slice [b_r, b_{r+1}) of each, its length proportional to r's free memory
(planning/memory.partition_bounds). What a rank holds between steps is its slices (nn.Parameters
registered on the unit's module, what the optimizer steps), their gradients and their optimizer
state: nothing else of the trainable model.

One unit's life in a step (hooks on the unit's module; the root's on the model):

  forward   pre-hook: the unit is gathered (each owner broadcasts its slice straight into the
            flat buffer: no padding, no copy; gloo's all_gather needs equal sizes) and the next
            unit's gather is started asynchronously (prefetch, FSDP2's order: forward order);
            `_Gather` (an autograd Function) hands the buffer to autograd and the module's
            parameters become views of it. Post-hook: the buffer's storage is freed (resized to
            0: the views the forward saved keep their shape and come back with the storage).
  backward  a hook on the unit's output: the unit is gathered again into the same storage and the
            previous unit's gather started (prefetch, backward order). `_Gather.backward` gets the
            whole flat gradient once every use of the unit is done; it is reduced to its owners
            (one dist.reduce per owner, of that owner's slice, in place in autograd's gradient: no
            extra memory, each element sent once, as a reduce-scatter; on gloo W reduces of the
            uneven slices took 21 ms for 16 MB where an uneven reduce_scatter of views took 33 ms),
            asynchronously: it runs while the next unit computes, and is waited for when the next
            one is issued (at most one in flight) and at the end of the backward. The owner keeps
            its slice divided by W (hetrain's loss weighting W·n_rk/N assumes the synchroniser
            divides by W, as DDP and FSDP2 do), and the buffer is freed.

The root stays gathered from the start of the forward to the end of its backward (FSDP2's root
too). Under no_sync (a rank's micro-batches but its last) nothing is freed and the flat gradients
accumulate locally: every rank then issues the same collectives in the same order, whatever its
number of micro-batches (the first forward gathers, the last backward re-gathers and reduces), as
under hetrain's FSDP2 (runtime/sharding/wrap.py). Between uses a module's parameter is a
meta-device placeholder of its shape: reading it outside the forward raises, never reads freed
memory. Every unit must run once per forward, in the same order on every rank.

Setting it up (shard_fully): units, fractions agreed by every rank, the fit check, the optimizer
over the owned slices (FullShardedOptimizer) and the synchroniser (FullSync). A rank's usable
memory less what it holds beyond its shards (its activations, buffers, frozen weights and the
gathered units: planning/memory.full_shard_transient) is its *free* memory; f_r = free_r / Σ free fills every device to the same fraction. The sharded state S
(trainable parameters, gradients, optimizer values) fits when S <= Σ free; when it does not, every
rank raises the same UsageError, with every rank's figures and the bytes missing on each (decided
from one all_gather of the figures: no rank goes on alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UsageError
from ...hardware.units import format_bytes
from ...planning.memory import capacity_fractions, full_shard_transient, partition_bounds, state_values
from ..ranks.collectives import collective_device
from .capacity import ELEMENTWISE, constructor_defaults, state_tensors


@dataclass(frozen=True)
class Slot:
    """A parameter of a segment: elements [offset, offset + numel) of its flat buffer."""
    name: str                                 # its name in the model (checkpoints)
    places: tuple[tuple[nn.Module, str], ...]  # (module, attribute) where it lives (tied: several)
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


class Segment:
    """One unit's trainable parameters of one param group, as one flat buffer split by `bounds`."""

    def __init__(self, slots: Sequence[Slot], values: Sequence[torch.Tensor], bounds: Sequence[int], *,
                 rank: int, group_index: int):
        self.slots, self.bounds, self.rank, self.group_index = list(slots), tuple(bounds), rank, group_index
        flat = torch.cat([v.detach().reshape(-1) for v in values])
        a, b = self.owned
        self.shard = nn.Parameter(flat[a:b].clone())
        self.buffer = flat                     # the gathered parameters; storage freed when not gathered
        self.nbytes = flat.numel() * flat.element_size()
        self.acc: torch.Tensor | None = None   # the flat gradient accumulated under no_sync
        self.free()

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    @property
    def owned(self) -> tuple[int, int]:
        return self.bounds[self.rank], self.bounds[self.rank + 1]

    def storage_ptr(self) -> int:
        return self.buffer.untyped_storage().data_ptr()

    def allocate(self) -> None:
        storage = self.buffer.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)

    def free(self) -> None:
        self.buffer.untyped_storage().resize_(0)


class Unit:
    """A module whose parameters are gathered together (a block, or the root)."""

    def __init__(self, name: str, segments: Sequence[Segment]):
        self.name, self.segments = name, list(segments)
        self.gathered = False
        self.works: list = []        # a gather in flight
        self.in_backward = False

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    def set_views(self, flats: Sequence[torch.Tensor]) -> None:
        for seg, flat in zip(self.segments, flats):
            for slot in seg.slots:
                view = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                for module, attr in slot.places:
                    setattr(module, attr, view)

    def clear_views(self) -> None:
        for seg in self.segments:
            for slot in seg.slots:
                placeholder = torch.empty(slot.shape, dtype=seg.shard.dtype, device="meta")
                for module, attr in slot.places:
                    setattr(module, attr, placeholder)


class _Gather(torch.autograd.Function):
    """Forward: the unit's gathered flat buffers, as tensors autograd tracks (aliases of the
    storage with their own version counters, so gathering into it again does not invalidate what
    the forward saved). Backward: hands the flat gradients to the sharding (reduced to their
    owners there); the shards' gradients are set by it, not by autograd."""

    @staticmethod
    def forward(ctx, sharding, unit, *shards):
        ctx.sharding, ctx.unit = sharding, unit
        return tuple(seg.buffer.data for seg in unit.segments)

    @staticmethod
    def backward(ctx, *grads):
        ctx.sharding.after_backward(ctx.unit, grads)
        return (None, None) + (None,) * len(grads)


class FullSharding:
    """The units of one model and the hooks that gather and reduce them (see the module's docstring)."""

    def __init__(self, model: nn.Module, root: Unit | None, blocks: Sequence[tuple[nn.Module, Unit]], *,
                 rank: int, world_size: int, fractions: Sequence[float], group=None,
                 device: torch.device | None = None):
        self.model, self.root, self.rank, self.world_size, self.group = model, root, rank, world_size, group
        self.fractions = tuple(fractions)
        self.blocks = [u for _, u in blocks]
        self.order = ([root] if root is not None else []) + self.blocks   # forward order
        # The job's device (where the shards live): every tensor handed to a collective is made there
        shards = self.shards()
        self.device = device if device is not None else shards[0].device if shards else collective_device(group)
        self.syncing = True
        self.pending: list[tuple[Segment, torch.Tensor, list]] = []        # reduces in flight
        self.applied = self.reduced = 0
        self.handles = [model.register_forward_pre_hook(lambda m, a: self._pre_forward(self.root)),
                        model.register_forward_hook(lambda m, a, out: self._model_post_forward())]
        for module, unit in blocks:
            self.handles.append(module.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u)))
            self.handles.append(module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out)))
        for unit in self.order:
            unit.clear_views()

    # -- what this rank holds ----------------------------------------------------------------------
    def segments(self) -> list[Segment]:
        return [s for u in self.order for s in u.segments]

    def shards(self) -> list[nn.Parameter]:
        return [s.shard for s in self.segments()]

    def is_gathered_storage(self, ptr: int) -> bool:
        """Is `ptr` a gathered unit's storage (model state the forward saves, not an activation)?"""
        return any(s.storage_ptr() == ptr for u in self.order if u.gathered for s in u.segments)

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    # -- gathering -----------------------------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        for seg in unit.segments:
            seg.allocate()
            a, b = seg.owned
            seg.buffer[a:b].copy_(seg.shard.detach())
            for r in range(self.world_size):
                lo, hi = seg.bounds[r], seg.bounds[r + 1]
                if hi > lo:
                    unit.works.append(dist.broadcast(seg.buffer[lo:hi], src=self.global_rank(r), group=self.group,
                                                     async_op=True))
        unit.gathered = True

    def _ensure_gathered(self, unit: Unit) -> None:
        if not unit.gathered:
            self._start_gather(unit)
        for work in unit.works:
            work.wait()
        unit.works = []

    def release(self, unit: Unit) -> None:
        self._ensure_gathered(unit)      # a prefetch in flight completes first (its peers wait on it)
        for seg in unit.segments:
            seg.free()
        unit.gathered = False
        unit.clear_views()

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        i = self.order.index(unit) + step
        return self.order[i] if 0 <= i < len(self.order) else None

    # -- hooks -----------------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit | None) -> None:
        if unit is None:
            return
        if unit.in_backward:               # a recompute (activation checkpointing): it is gathered
            unit.set_views([s.buffer.data for s in unit.segments])
            return
        self._ensure_gathered(unit)
        nxt = self._neighbour(unit, +1)
        if nxt is not None and not nxt.gathered:
            self._start_gather(nxt)
        if torch.is_grad_enabled():
            if unit is self.order[0] and self.reduced == self.applied:
                self.applied = self.reduced = 0
            self.applied += 1
            unit.set_views(_Gather.apply(self, unit, *[s.shard for s in unit.segments]))
        else:
            unit.set_views([s.buffer.data for s in unit.segments])

    def _post_forward(self, unit: Unit, output) -> None:
        if unit.in_backward:
            return
        grad = torch.is_grad_enabled()
        if self.syncing:                   # the views keep their shape; the storage comes back in backward
            self._ensure_gathered(unit)
            for seg in unit.segments:
                seg.free()
            unit.gathered = False
            if not grad:
                unit.clear_views()
        if grad:
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, lambda g, u=unit: self._pre_backward(u),
                                                              mode="any")

    def _model_post_forward(self) -> None:
        if not torch.is_grad_enabled() and self.syncing:     # evaluation: nothing stays gathered
            for unit in self.order:
                if unit.gathered:
                    self.release(unit)

    def _pre_backward(self, unit: Unit) -> None:
        unit.in_backward = True
        if not unit.gathered:
            self._start_gather(unit)       # into the storage the forward's saved views share
        self._ensure_gathered(unit)
        prev = self._neighbour(unit, -1)
        if prev is not None and not prev.gathered:
            self._start_gather(prev)

    def after_backward(self, unit: Unit, grads: Sequence[torch.Tensor | None]) -> None:
        """`_Gather.backward`: the unit's whole flat gradients; accumulate (no_sync) or reduce."""
        unit.in_backward = False
        for seg, g in zip(unit.segments, grads):
            g = torch.zeros(seg.numel, dtype=seg.shard.dtype, device=self.device) if g is None else g
            if not self.syncing:
                seg.acc = g.clone() if seg.acc is None else seg.acc.add_(g)
                continue
            if seg.acc is not None:
                g, seg.acc = seg.acc.add_(g), None
            self.wait_reduces()            # at most one unit's reduce in flight
            works = [dist.reduce(g[seg.bounds[r]:seg.bounds[r + 1]], dst=self.global_rank(r), group=self.group,
                                 async_op=True)
                     for r in range(self.world_size) if seg.bounds[r + 1] > seg.bounds[r]]
            self.pending.append((seg, g, works))
        if self.syncing:
            self.release(unit)
        self.reduced += 1
        if self.reduced >= self.applied:   # the backward's last unit: every gradient in place now
            self.wait_reduces()

    def wait_reduces(self) -> None:
        for seg, g, works in self.pending:
            for work in works:
                work.wait()
            a, b = seg.owned
            mine = g[a:b] / self.world_size
            seg.shard.grad = mine if seg.shard.grad is None else seg.shard.grad.add_(mine)
        self.pending = []

    # -- the loop ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """A rank's micro-batches but its last: units stay gathered, gradients accumulate locally."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the whole model's gradient norm: the owned slices are disjoint, so their squared
        norms summed over the ranks (one all-reduce) are the whole gradient's."""
        self.wait_reduces()
        grads = [s.grad for s in self.shards() if s.grad is not None]
        dtype = grads[0].dtype if grads else torch.float32
        # made on the job's device even on a rank holding no gradients (NCCL takes no CPU tensor)
        sq = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=self.device))
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        scale = min(1.0, max_norm / (norm.item() + 1e-6))
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        return norm.to(dtype)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter whole, by name (a collective; for tests and inspection)."""
        out = {}
        for unit in self.order:
            was = unit.gathered
            self._ensure_gathered(unit)
            for seg in unit.segments:
                for slot in seg.slots:
                    out[slot.name] = seg.buffer[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            if not was:
                self.release(unit)
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's gradient whole, by name (a collective; zeros where none)."""
        self.wait_reduces()
        out = {}
        for seg in self.segments():
            whole = torch.zeros(seg.numel, dtype=seg.shard.dtype, device=self.device)
            a, b = seg.owned
            if seg.shard.grad is not None:
                whole[a:b] = seg.shard.grad
            dist.all_reduce(whole, group=self.group)
            for slot in seg.slots:
                out[slot.name] = whole[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return out



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

def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, Mapping):
        return [t for o in output.values() for t in _tensors(o)]
    return []
