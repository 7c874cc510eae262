"""The data-parallel wrapper, with or without sharding, composed with uneven per-rank batches.

    sharding   wrapper                                   what each rank holds
    none       DDP                                       everything
    zero1      DDP + ZeroRedundancyOptimizer             optimizer state: an even 1/W
    capacity   DDP + CapacityShardedOptimizer            optimizer state: ∝ its free memory
    fsdp       FSDP2 fully_shard per block + root        params, grads, state: 1/W (+ units in use)
    capacity-full  flat units per block + root           params, grads, state: ∝ its free memory
                   (capacity_full.py)                    (+ units in use)

Why the big-batch math survives every one of them: hetrain weights each micro-batch's loss by
W·n_rk/N (runtime/loop/reduce.py) because the synchroniser divides the summed gradient by W. DDP's
all-reduce and FSDP2's reduce-scatter both do exactly that (FSDP2's default divide factor is the
world size), and ZeRO-1 / capacity sharding step on the all-reduced gradient. So the gradients
equal the single-device big batch under every strategy (tests/dist/test_sharding.py).

Micro-batches under FSDP2. FSDP2 all-gathers parameters in every forward and backward, so ranks
running different numbers of micro-batches would issue different numbers of collectives and hang.
On every micro-batch but a rank's last, hetrain turns off gradient sync AND resharding (FSDP2's
own recipe for accumulation without communication, forward included): the first forward
all-gathers each unit once, the others find it unsharded, and the last micro-batch runs the usual
FSDP2 forward/backward with the reduce-scatter. Every rank then issues the same collectives, in
the same order, whatever its micro-batch count. The price: a rank that accumulates holds its whole
parameters and gradients during the step (its optimizer state stays sharded); with one
micro-batch per rank it is full ZeRO-3.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import UsageError
from ...vocabulary import SHARDINGS
from ...hardware.units import format_bytes
from ...planning.memory import capacity_fractions
from ..user_objects import find_blocks
from .capacity import CapacityShardedOptimizer, constructor_defaults



@dataclass
class Wrapped:
    strategy: str                         # what runs (may be 'none' where sharding cannot help)
    forward_module: nn.Module             # what the model's forward goes through
    optimizer: torch.optim.Optimizer      # what ht.step() steps; prepare() returns it
    sync: object                          # .no_sync(): skip gradient sync on a non-last micro-batch
    lines: list[str] = field(default_factory=list)   # what was done and why, for the log
    fraction: float | None = None         # this rank's share of the optimizer state
    units: list[int] = field(default_factory=list)   # FSDP2: parameters per sharded unit
    root_params: int = 0                  # FSDP2: parameters outside the units

    def sync_guard(self):
        """What OOM recovery uses to complete the collectives an OOM interrupted under FSDP2: the
        `fsdp_guard.FSDPGuard` prepare() taught the step's collectives (runtime/memory/device_memory.py),
        None before that. DDP's (resilience/oom.py SyncGuard, with the gradient hook) is setup.py's."""
        return getattr(self.sync, "guard", None)


def rebuild_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[nn.Parameter, nn.Parameter], *,
                      who: str = "sharding", over: str = "the sharded parameters",
                      otherwise: str = ", or sharding='none'"):
    """The same optimizer class, hyperparameters and param groups over new parameter objects; a
    parameter `mapping` leaves out is dropped (a pipeline stage keeps its own)."""
    if optimizer.state:
        raise UsageError(f"{who} needs a fresh optimizer, but this one has state already",
                         "pass the optimizer to prepare() before any optimizer step")
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [mapping[p] for p in g["params"] if p in mapping]} for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **constructor_defaults(optimizer))
    except (TypeError, ValueError) as e:
        raise UsageError(f"cannot rebuild {type(optimizer).__name__} over {over}: {e}",
                         f"use a torch.optim optimizer{otherwise}") from None


class FSDPSync:
    """`no_sync()` for FSDP2: no gradient reduction and no resharding on non-last micro-batches.
    `guard`: the OOM guard (runtime/sharding/fsdp_guard.py) once prepare() made one; `reset()`
    readies FSDP2 for an agreed redo of the step."""

    def __init__(self, root: nn.Module, units: list[nn.Module]):
        self.root, self.units = root, units
        self.guard = None

    def make_guard(self, run_one_step) -> int:
        """Install the recording guard and learn one step's collectives (a collective); returns
        how many a step issues."""
        from .fsdp_guard import FSDPGuard

        self.guard = FSDPGuard(self.root, self.units)
        return self.guard.learn(run_one_step)

    def reset(self) -> None:
        """After an agreed redo (every rank): FSDP2's state as at the start of a step."""
        if self.guard is not None:
            self.guard.reset()
        else:
            self.root.zero_grad(set_to_none=True)
            self.root.reset_iter_state()

    @contextlib.contextmanager
    def no_sync(self):
        root = self.root
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        root.set_reshard_after_forward(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            for unit in self.units:     # back to how they were built: units reshard, the root keeps
                unit.set_reshard_after_forward(True, recurse=False)
            root.set_reshard_after_forward(False, recurse=False)


def _ddp(model: nn.Module, device: torch.device) -> DDP:
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, *, strategy: str, device: torch.device,
         rank: int, world_size: int, free_bytes: float | None = None, block_type: str | None = None,
         accumulates: bool = False, meter=None) -> Wrapped:
    """Wrap `model` (already on `device`) and `optimizer` for data parallelism under `strategy`.
    A collective: every rank calls it with the same strategy. `free_bytes`: this rank's memory
    left for optimizer state (capacity sharding; None: unknown, even split)."""
    if strategy not in SHARDINGS:
        raise UsageError(f"sharding {strategy!r} is not known", f"use one of {SHARDINGS}")
    if strategy != "none" and world_size == 1:
        ddp = _ddp(model, device)
        return Wrapped("none", ddp, optimizer, ddp, [
            f"sharding={strategy!r} asked for, but this job has one device: there is nothing to shard "
            "across, so it runs unsharded (launch on 2+ devices to shard)"])
    if strategy == "none":
        ddp = _ddp(model, device)
        return Wrapped("none", ddp, optimizer, ddp)
    if strategy == "zero1":
        return _zero1(model, optimizer, device, world_size)
    if strategy == "capacity":
        return _capacity(model, optimizer, device, rank, world_size, free_bytes)
    if strategy == "capacity-full":
        return _capacity_full(model, optimizer, rank, world_size, free_bytes, block_type, accumulates, meter)
    return _fsdp(model, optimizer, device, world_size, block_type, accumulates, meter)


def _zero1(model, optimizer, device, world_size) -> Wrapped:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if optimizer.state:
        raise UsageError("sharding='zero1' needs a fresh optimizer, but this one has state already",
                         "pass the optimizer to prepare() before any optimizer step")
    ddp = _ddp(model, device)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
              for g in optimizer.param_groups]
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **constructor_defaults(optimizer))
    return Wrapped("zero1", ddp, zero, ddp, fraction=1.0 / world_size, lines=[
        f"sharding=zero1: optimizer state split evenly over {world_size} devices "
        "(ZeroRedundancyOptimizer); gradients all-reduced by DDP, parameters broadcast after the step"])


def _capacity(model, optimizer, device, rank, world_size, free_bytes) -> Wrapped:
    mine = -1.0 if free_bytes is None else float(free_bytes)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if any(f < 0 for f in everyone):
        fractions = tuple(1.0 / world_size for _ in range(world_size))
        why = "free memory unknown on some device (no cap, no CUDA): even split"
    else:
        fractions = capacity_fractions(everyone)
        why = "in proportion to free memory " + " : ".join(format_bytes(f) for f in everyone)
    sharded = CapacityShardedOptimizer(optimizer, fractions, rank=rank, world_size=world_size)
    ddp = _ddp(model, device)   # after flattening: DDP sees the parameters as they will stay
    sizes = sharded.slice_sizes()
    return Wrapped("capacity", ddp, sharded, ddp, fraction=fractions[rank], lines=[
        "sharding=capacity: optimizer state split " + " / ".join(f"{f:.0%}" for f in fractions)
        + f" ({why}); elements per rank " + ", ".join(str([s[r] for s in sizes]) for r in range(world_size))])


def _capacity_full(model, optimizer, rank, world_size, free_bytes, block_type, accumulates, meter) -> Wrapped:
    from ..user_objects import optimizer_kind
    from .capacity_full import FullSync, shard_fully

    blocks = [m for _, m in find_blocks(model, block_type)]
    sharding, opt, lines = shard_fully(model, optimizer, rank=rank, world_size=world_size, blocks=blocks,
                                       free_bytes=free_bytes, accumulates=accumulates, meter=meter,
                                       optimizer_kind=optimizer_kind(optimizer))
    units = [u.numel for u in sharding.blocks]
    lines.append("  in-loop OOM recovery is off under capacity-full (an OOM between its collectives would leave "
                 "peers waiting): an OOM ends the attempt and --max-restarts resumes with smaller micro-batches")
    return Wrapped("capacity-full", model, opt, FullSync(sharding), lines=lines,
                   fraction=sharding.fractions[rank], units=units,
                   root_params=sharding.root.numel if sharding.root is not None else 0)


def shard_blocks(model: nn.Module, blocks, *, device: torch.device, world_size: int) -> None:
    """FSDP2 as hetrain applies it, in place: each block its own unit, resharded after its
    forward; the root (what is left) kept gathered between forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for b in blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def _fsdp(model, optimizer, device, world_size, block_type, accumulates, meter) -> Wrapped:
    names = {p: n for n, p in model.named_parameters()}
    blocks = [m for _, m in find_blocks(model, block_type)]
    unit_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    in_units = {id(p) for b in blocks for p in b.parameters()}
    root_params = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    shard_blocks(model, blocks, device=device, world_size=world_size)
    new = dict(model.named_parameters())
    opt = rebuild_optimizer(optimizer, {p: new[n] for p, n in names.items()})
    element = next(iter(new.values())).element_size() if new else 4
    total = sum(p.numel() for p in new.values())
    if meter is not None:
        # FSDP2 all-gathers a unit into fresh storage for each forward/backward: those saved
        # weights are model state, not activations; count them once, as `transient`.
        meter.saved_is_state = _unsharded_storages(model)
        if accumulates:
            meter.transient = int(2 * total * element * (1 - 1 / world_size))
        else:
            meter.transient = int((root_params + 2 * max(unit_params, default=0)) * element)
    lines = [f"sharding=fsdp: FSDP2 over {len(blocks)} block(s) + the root; parameters, gradients and "
             f"optimizer state split evenly over {world_size} devices"]
    if accumulates:
        lines.append("  this rank runs several micro-batches: it keeps the whole model unsharded during "
                     "a step (no communication between micro-batches; ranks may run different counts)")
    return Wrapped("fsdp", model, opt, FSDPSync(model, blocks), lines=lines, fraction=1.0 / world_size,
                   units=unit_params, root_params=root_params)


def _unsharded_storages(model: nn.Module):
    """Predicate on a storage pointer: is it one of the model's parameters as they are now (FSDP2
    registers the unsharded parameters on the module while a unit computes)?"""
    from torch.distributed.tensor import DTensor

    def check(ptr: int) -> bool:
        return any(not isinstance(p, DTensor) and p.untyped_storage().data_ptr() == ptr
                   for p in model.parameters())
    return check
