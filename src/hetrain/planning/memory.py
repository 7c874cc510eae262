"""Memory per device: model state under each sharding, activations with and without
checkpointing, and the sharding choice (pure: no torch, no processes).

Model state of a data-parallel rank, for P parameters of `param_bytes` each:

    strategy   parameters     gradients      optimizer state (k values/param of `state_bytes`)
    none       P              P              k·P                      every rank, DDP
    zero1      P              P              k·P / W                  even split (ZeroRedundancyOptimizer)
    capacity   P              P              k·P · f_r                f_r ∝ free memory of rank r
    fsdp       P / W          P / W          k·P / W                  + transient unsharded units
    capacity-full  P · f_r    P · f_r        k·P · f_r                + transient gathered units

Fine-tuning (some parameters frozen, e.g. LoRA adapters on a frozen base): of P parameters only
the T trainable ones have gradients and optimizer state; the P − T frozen ones are weights only,
at their own element size (`frozen_param_bytes`: a frozen base is usually kept in bf16 while the
adapters train in fp32). Sharding splits the frozen weights with the rest (fsdp) or not at all.

This is the one model of it (`state_bytes`): the catalog estimate (cost.fixed_bytes), the bytes
a pipeline stage holds per byte of its parameters (`state_factor`) and the runtime's memory
check all come from it.

FSDP2 (ZeRO-3) all-gathers one unit (block) at a time: it adds the unsharded root parameters plus
two units (the one computing and the one prefetched). When a rank accumulates several
micro-batches it keeps the whole model unsharded through the step (no communication between
micro-batches, so ranks may run different numbers of them): then parameters and gradients are
whole during the step, and only the optimizer state stays sharded at the peak.

Capacity-proportional sharding gives rank r the fraction f_r = free_r / Σ free of the optimizer
state, which minimises max_r(state_r / free_r): every device is filled to the same fraction,
so an 80 GB + 24 GB pair holds what an even split (capped by the 24 GB card) cannot.

Capacity-full sharding splits all three by f_r. Its transient (`full_shard_transient`) is what it
holds gathered: the root and two blocks (the one computing, the one prefetched), each with its
flat gradient while it is reduced, so (root + 2·largest block)·2; a rank that accumulates keeps
the whole trainable model gathered and its whole gradient. f_r ∝ (usable − transient −
activations)_r, which fills every device to the same fraction; the bound, against an even split,
is Σ free / (W · min free): (80 + 24) / (2 · 24) ≈ 2.17× for an 80 GB + 24 GB pair.

Optimizer-state offload (`offload=True`; planning/savers.py decides where and costs it): the
device keeps its parameters and gradients at the training precision (`device_param_bytes`, 2 at
bf16) and no optimizer state; host memory holds what the optimizer steps on, the fp32 copy of
its slice of the trainable parameters and their state (`StateBytes.host`). At bf16 and AdamW:
2 + 2 bytes per trainable parameter on the device (of its shard), 4 + 8 on the host — the 16
bytes of the unoffloaded count, moved, not lost. Gathered units and whole-model buffers are then
at the training precision too.

Activations per sample, for a model of L repeated blocks: `outside + L·block_saved` without
checkpointing; with it, `outside + L·block_input + block_saved` (each block keeps its input; one
block's inside is recomputed at a time during backward). With the first k of the L checkpointed
(the runtime's DevicePlan.checkpoint_blocks), `outside + k·block_input + (L−k)·block_saved`: the
last L−k blocks' backward ends before the first recompute, which then needs one block's inside
again, within what they freed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..vocabulary import AUTO_SHARDINGS, SHARDINGS


# Optimizer state values per parameter (each `state_bytes`, fp32 in torch's optimizers).
STATE_VALUES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adam-amsgrad": 3, "adamw-amsgrad": 3,
                "rmsprop": 1, "rmsprop-momentum": 2, "adagrad": 1, "adamax": 2, "nadam": 2, "radam": 2,
                "adadelta": 2}


def state_values(optimizer: str) -> int:
    try:
        return STATE_VALUES[optimizer]
    except KeyError:
        raise UsageError(f"unknown optimizer {optimizer!r} for the memory model",
                         f"use one of {sorted(STATE_VALUES)}") from None


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes of model state one device holds."""

    params: float
    grads: float
    optimizer: float
    transient: float = 0.0    # FSDP2's unsharded parameters (and gradients) while they are in use
    host: float = 0.0         # offload: bytes in host memory (not in total: the device does not hold them)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.transient


def check_trainable(n_params: int, trainable: int | None, where: str = "the model") -> int:
    """The trainable parameter count (None: all of them), checked against the total."""
    if trainable is None:
        return n_params
    if not isinstance(trainable, int) or isinstance(trainable, bool) or trainable < 0:
        raise UsageError(f"{where}: trainable parameters {trainable!r} is not a count",
                         "give a whole number of trainable parameters, e.g. --trainable-params 13.6e6")
    if trainable > n_params:
        raise UsageError(f"{where}: trainable parameters {trainable:,} are more than its {n_params:,} parameters",
                         "give at most the model's parameters (all of them: leave --trainable-params out)")
    return trainable


def state_bytes(n_params: int, *, sharding: str = "none", world_size: int = 1, fraction: float | None = None,
                optimizer: str = "adamw", param_bytes: int = 4, state_bytes_per_value: int = 4,
                unit_params: Sequence[int] = (), root_params: int = 0, accumulates: bool = False,
                trainable: int | None = None, frozen_param_bytes: float | None = None, offload: bool = False,
                device_param_bytes: float | None = None) -> StateBytes:
    """Model state on one device. `fraction`: this device's share of the optimizer state under
    'capacity' (default 1/W). FSDP: `unit_params` = parameters of each sharded unit (block),
    `root_params` = those outside the units, `accumulates` = the rank runs several micro-batches.
    Fine-tuning: `trainable` of the `n_params` have gradients and optimizer state (None: all), the
    rest are weights of `frozen_param_bytes` each (None: `param_bytes`). `offload`: the optimizer's
    slice in host memory, parameters and gradients on the device at `device_param_bytes` (None:
    `param_bytes`; see the module's docstring)."""
    if offload:
        kw = dict(sharding=sharding, world_size=world_size, fraction=fraction, optimizer=optimizer,
                  state_bytes_per_value=state_bytes_per_value, unit_params=unit_params, root_params=root_params,
                  accumulates=accumulates, trainable=trainable, frozen_param_bytes=frozen_param_bytes)
        full = state_bytes(n_params, param_bytes=param_bytes, **kw)
        low = param_bytes if device_param_bytes is None else device_param_bytes
        kept = state_bytes(n_params, param_bytes=low, **{**kw, "frozen_param_bytes": (
            param_bytes if frozen_param_bytes is None else frozen_param_bytes)})
        whole_opt = float(check_trainable(n_params, trainable)) * state_values(optimizer) * state_bytes_per_value
        owned = _owned(sharding, world_size, fraction)
        masters = float(check_trainable(n_params, trainable)) * param_bytes * owned
        return StateBytes(params=kept.params, grads=kept.grads, optimizer=0.0, transient=kept.transient,
                          host=(full.optimizer if whole_opt else 0.0) + masters)
    if sharding not in SHARDINGS:
        raise UsageError(f"sharding {sharding!r} is not known", f"use one of {SHARDINGS}")
    if world_size < 1:
        raise UsageError(f"world_size {world_size} must be >= 1", "count the devices")
    t = check_trainable(n_params, trainable)
    frozen_bytes = param_bytes if frozen_param_bytes is None else frozen_param_bytes
    p = float(t) * param_bytes + float(n_params - t) * frozen_bytes
    g = float(t) * param_bytes
    opt = float(t) * state_values(optimizer) * state_bytes_per_value
    if sharding == "none" or world_size == 1:
        return StateBytes(params=p, grads=g, optimizer=opt)
    if sharding == "zero1":
        return StateBytes(params=p, grads=g, optimizer=opt / world_size)
    if sharding == "capacity":
        f = 1.0 / world_size if fraction is None else fraction
        if not 0 <= f <= 1:
            raise UsageError(f"capacity fraction {f} is not in [0, 1]", "pass this device's share of the state")
        return StateBytes(params=p, grads=g, optimizer=opt * f)
    if sharding == "capacity-full":
        f = 1.0 / world_size if fraction is None else fraction
        if not 0 <= f <= 1:
            raise UsageError(f"capacity fraction {f} is not in [0, 1]", "pass this device's share of the state")
        transient = full_shard_transient(unit_params, root_params, param_bytes=param_bytes, accumulates=accumulates,
                                         trainable=t)
        return StateBytes(params=float(t) * param_bytes * f + float(n_params - t) * frozen_bytes, grads=g * f,
                          optimizer=opt * f, transient=transient)
    # fsdp
    if accumulates:
        transient = (p + g) - (p + g) / world_size      # whole parameters and gradients during the step
    else:
        largest = max(unit_params, default=0)
        transient = (root_params + 2 * largest) * (p / n_params if n_params else param_bytes)
    return StateBytes(params=p / world_size, grads=g / world_size, optimizer=opt / world_size,
                      transient=min(transient, p + g))


def _owned(sharding: str, world_size: int, fraction: float | None) -> float:
    """The slice of the trainable parameters whose update this device owns."""
    if sharding == "none" or world_size == 1:
        return 1.0
    if sharding in ("capacity", "capacity-full"):
        return 1.0 / world_size if fraction is None else fraction
    return 1.0 / world_size


def full_shard_transient(unit_params: Sequence[int], root_params: int, *, param_bytes: float,
                         accumulates: bool = False, trainable: int | None = None) -> float:
    """Bytes a capacity-full rank holds beyond its shards (see the module's docstring)."""
    if accumulates:
        whole = trainable if trainable is not None else root_params + sum(unit_params)
        return 2.0 * whole * param_bytes
    return 2.0 * (root_params + 2 * max(unit_params, default=0)) * param_bytes


def state_factor(optimizer: str = "adamw", *, param_bytes: int = 4, state_bytes_per_value: int = 4) -> float:
    """Unsharded model-state bytes per byte of parameters, (2·param_bytes + k·state_bytes) /
    param_bytes: for pipeline stages, whose blocks are profiled in parameter bytes, not counts."""
    one = state_bytes(1, optimizer=optimizer, param_bytes=param_bytes, state_bytes_per_value=state_bytes_per_value)
    return one.total / param_bytes


ADAMW_STATE_FACTOR = state_factor("adamw")     # 4.0: fp32 parameters, gradients and AdamW's two moments


def capacity_fractions(free_bytes: Sequence[float]) -> tuple[float, ...]:
    """Each device's fraction of the sharded state, in proportion to its free memory.
    A device with no free memory gets none; at least one must have some."""
    free = [max(0.0, float(f)) for f in free_bytes]
    total = sum(free)
    if not free or total <= 0:
        raise UsageError(f"no device has free memory for optimizer state (free bytes {list(free_bytes)})",
                         "use a smaller model, activation checkpointing, or sharding='fsdp'")
    return tuple(f / total for f in free)


def partition_bounds(n: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """W+1 boundaries splitting range(n) in proportion to `fractions` (largest remainders)."""
    if n < 0 or not fractions or any(f < 0 for f in fractions):
        raise ValueError(f"cannot partition {n} by {list(fractions)}")
    total = sum(fractions)
    exact = [n * f / total for f in fractions]
    sizes = [math.floor(x) for x in exact]
    for i in sorted(range(len(sizes)), key=lambda i: exact[i] - sizes[i], reverse=True)[: n - sum(sizes)]:
        sizes[i] += 1
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return tuple(bounds)


# -- activations --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """Saved-for-backward bytes per sample of a model with `blocks` repeated blocks."""

    outside: float           # embeddings, final norm, head, loss
    block_saved: float       # inside one block (its input included)
    block_input: float       # one block's input (what a checkpointed block keeps)
    blocks: int

    @property
    def full(self) -> float:
        return self.outside + self.blocks * self.block_saved


def activation_bytes_per_sample(profile: ActivationProfile, *, checkpointing: bool, blocks: int | None = None) -> float:
    """Saved bytes per sample; `blocks`: the first k blocks checkpointed (None: every block)."""
    n = profile.blocks
    if not checkpointing or n == 0 or blocks == 0:
        return profile.full
    k = n if blocks is None else min(blocks, n)
    if not 0 < k:
        raise UsageError(f"checkpointed blocks {blocks!r}", f"give a count in 0..{n}, or None for every block")
    return profile.outside + k * profile.block_input + max(n - k, 1) * profile.block_saved


def transformer_profile(*, seq_len: int, d_model: int, n_layers: int, vocab: int,
                        value_bytes: int = 4) -> ActivationProfile:
    """An estimate for a pre-norm GPT block with a 4x MLP and fused attention (no T x T matrix
    kept): ~17 values per token per block saved (Korthikanti et al. 2022 count 34 bytes at 2
    bytes a value), 2 of the model width plus 2 of the vocabulary outside (final norm, head and
    the loss's softmax). Measure the real model when it matters (runtime probe)."""
    per_token = value_bytes * seq_len
    return ActivationProfile(outside=per_token * (2 * d_model + 2 * vocab),
                             block_saved=per_token * 17 * d_model,
                             block_input=per_token * d_model, blocks=n_layers)


# -- choosing a sharding ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    label: str
    capacity: float            # bytes usable (after any margin)
    activations: float         # bytes of activations at its planned micro-batch


@dataclass(frozen=True, kw_only=True)
class ShardingOption:
    strategy: str
    state: tuple[StateBytes, ...]     # per device
    peak: tuple[float, ...]           # per device: state + activations

    def fits(self, devices: Sequence[DeviceMemory]) -> bool:
        return all(p <= d.capacity for p, d in zip(self.peak, devices))

    def headroom(self, devices: Sequence[DeviceMemory]) -> float:
        """The smallest free fraction left on any device (negative: does not fit)."""
        return min((d.capacity - p) / d.capacity for p, d in zip(self.peak, devices))


def sharding_options(n_params: int, devices: Sequence[DeviceMemory], *, optimizer: str = "adamw",
                     param_bytes: int = 4, unit_params: Sequence[int] = (), root_params: int = 0,
                     accumulates: Sequence[bool] | None = None, trainable: int | None = None,
                     frozen_param_bytes: float | None = None) -> list[ShardingOption]:
    """Per-device memory of every strategy, for the planner to show and choose from."""
    w = len(devices)
    acc = list(accumulates) if accumulates is not None else [False] * w
    common = dict(world_size=w, optimizer=optimizer, param_bytes=param_bytes, trainable=trainable,
                  frozen_param_bytes=frozen_param_bytes)
    full = state_bytes(n_params, sharding="none", **common)
    free = [d.capacity - d.activations - full.params - full.grads for d in devices]
    try:
        fractions = capacity_fractions(free)
    except UsageError:
        fractions = tuple(1.0 / w for _ in devices)
    out = []
    for strategy in AUTO_SHARDINGS:       # capacity-full is asked for by name (vocabulary.py)
        states = tuple(
            state_bytes(n_params, sharding=strategy, fraction=fractions[r], unit_params=unit_params,
                        root_params=root_params, accumulates=acc[r], **common)
            for r in range(w))
        out.append(ShardingOption(strategy=strategy, state=states,
                                  peak=tuple(s.total + d.activations for s, d in zip(states, devices))))
    return out


def choose_sharding(options: Sequence[ShardingOption], devices: Sequence[DeviceMemory]) -> tuple[ShardingOption, str]:
    """The first option that fits every device, in the order none, zero1, capacity, fsdp (least
    communication first: zero1 and capacity add one broadcast of the parameters per step, fsdp
    all-gathers them forward and backward). Raises UsageError when none fits. The rule is the
    chooser's (planning/chooser.py) over these options as DP-family rows: no speed is predicted
    here, so they tie and the simplest that fits wins."""
    from .chooser import Request, choose
    from .rows import FAMILIES, LayoutRow

    rows = [LayoutRow(name=o.strategy, family=FAMILIES[o.strategy], fits=o.fits(devices),
                      samples_per_s=1.0 if o.fits(devices) else 0.0, memory=o.peak, comm_bytes=0.0, comm_s=0.0,
                      detail="", run="", spec={"kind": "DataParallel", "sharding": o.strategy}) for o in options]
    picked = choose(rows, Request(families=tuple(FAMILIES[o.strategy] for o in options))).row
    for option in options:
        if picked is not None and option.strategy == picked.name:
            if option.strategy == "none":
                return option, "the model state and activations fit every device unsharded"
            tighter = [o.strategy for o in options[:options.index(option)]]
            return option, (f"{', '.join(tighter)} would not fit "
                            + ", ".join(f"{d.label}" for d, p in zip(devices, options[0].peak) if p > d.capacity)
                            + f"; {option.strategy} leaves {option.headroom(devices):.0%} free on the fullest device")
    best = max(options, key=lambda o: o.headroom(devices))
    raise UsageError(
        f"the model does not fit under any sharding (best: {best.strategy}, needs "
        + ", ".join(f"{p / 2**30:.2f} GiB on {d.label} of {d.capacity / 2**30:.2f}" for p, d in zip(best.peak, devices))
        + ")",
        "use activation checkpointing, smaller micro-batches, a smaller model, or more devices")
