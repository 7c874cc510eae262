"""What the planner is asked (PlanOptions), and how each device fits in memory under it: its
micro-batch cap and checkpointing, or why it cannot take one sample. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.units import format_bytes
from .collectives import FREE_LINK, Link
from .profile import DeviceProfile


OFFLOADS = ("plan", "all", "none")       # --offload: where needed to fit | every device | never


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What the planner is asked; every error names the fix."""

    global_batch: int
    grad_bytes: float = 0.0              # bytes all-reduced per step (fp32 gradients)
    link: Link | None = None             # slowest link; None: from the profiles' link_gbs, else not modelled
    memory_margin: float = 0.10          # fraction of each device's memory kept free
    micro_batch_cap: int | None = None   # cap on every micro-batch
    allow_exclusion: bool = True         # False: every device takes >= 1 sample (its process is running)
    allow_checkpointing: bool = True     # False while the runtime cannot checkpoint activations
    sync_s: float | None = None          # measured exposed gradient sync per step (replaces the ring model)
    agree_s: float = 0.0                 # hetrain's per-step agreement all-reduce, measured (not plain DDP's)
    offload: str = "plan"                # optimizer state on host: plan (where needed to fit) | all | none
    host_memory_bytes: float | None = None   # host memory for offloaded state, all hosts (None: none known)
    offload_ranks: frozenset[int] = frozenset()   # devices (profile indices) whose optimizer state is on host
    share_caps: tuple[int | None, ...] = ()       # per device, the largest share (a rank that must not accumulate)
                                                  # (checkpointing then makes room for it as one micro-batch)

    def __post_init__(self) -> None:
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise UsageError(f"global batch {self.global_batch!r} must be a positive integer",
                             "give the samples per optimizer step over all devices, e.g. --global-batch 256")
        if not (self.grad_bytes >= 0 and math.isfinite(self.grad_bytes)):
            raise UsageError(f"gradient bytes {self.grad_bytes!r}", "give the bytes all-reduced per step, >= 0")
        if not 0 <= self.memory_margin < 1:
            raise UsageError(f"memory margin {self.memory_margin!r}", "use a fraction in [0, 1), e.g. 0.1")
        if self.micro_batch_cap is not None and self.micro_batch_cap < 1:
            raise UsageError(f"micro-batch cap {self.micro_batch_cap}", "use a positive cap, or none")
        if self.sync_s is not None and not (self.sync_s >= 0 and math.isfinite(self.sync_s)):
            raise UsageError(f"sync seconds {self.sync_s!r}", "give the measured exposed sync, >= 0, or none")
        if not (self.agree_s >= 0 and math.isfinite(self.agree_s)):
            raise UsageError(f"agreement seconds {self.agree_s!r}", "give the measured per-step agreement, >= 0")
        if self.offload not in OFFLOADS:
            raise UsageError(f"offload {self.offload!r}", f"use one of {', '.join(OFFLOADS)}")
        if self.host_memory_bytes is not None and not self.host_memory_bytes >= 0:
            raise UsageError(f"host memory {self.host_memory_bytes!r}", "give the host's memory in bytes, e.g. "
                             "--host-memory 256GiB")
        if any(c is not None and c < 1 for c in self.share_caps):
            raise UsageError(f"share caps {self.share_caps}", "give each device's largest share, >= 1, or none")


@dataclass(frozen=True, kw_only=True)
class Fit:
    """How a device fits in memory: micro-batch cap and checkpointing, or why it cannot."""

    micro: int                # cap on its micro-batch (>= 1), or 0 when it cannot fit one sample
    checkpointing: bool
    memory_reason: str
    memory_cap: int | None = None   # the cap memory alone sets (None: memory does not limit it)
    checkpoint_blocks: int | None = None   # with checkpointing: the fewest blocks that fit (None: every block)

    @property
    def ckpt(self) -> dict:
        return {"checkpointing": self.checkpointing, "blocks": self.checkpoint_blocks}


def fit(p: DeviceProfile, o: PlanOptions, *, want: int = 1) -> Fit:
    """`want`: the micro-batch checkpointing should make room for (1: one sample; more for a
    device that must run its whole share at once, savers.dp_plan)."""
    margin = o.memory_margin
    cap = p.max_micro_batch(margin=margin)
    ckpt, blocks = False, None
    if cap is not None and cap < want and o.allow_checkpointing:   # the fewest blocks checkpointed that fit
        choice = p.fewest_blocks(margin=margin, micro=want)
        if choice is not None:
            ckpt, blocks = choice
            cap = p.max_micro_batch(margin=margin, checkpointing=True, blocks=blocks)
    limit = o.global_batch
    if o.micro_batch_cap is not None:
        limit = min(limit, o.micro_batch_cap)
    if p.memory_bytes is None:
        why = "memory not capped"
    else:
        why = (f"{format_bytes(p.memory_bytes)} memory, {format_bytes(p.fixed_bytes)} model state, "
               f"{format_bytes(p.activation_bytes_per_sample)}/sample"
               + (f" + {format_bytes(p.activation_fixed_bytes)}/micro-batch" if p.activation_fixed_bytes else "")
               + (f" (×{p.keep_fraction(checkpointing=True, blocks=blocks):.2g} with activation checkpointing"
                  + (f" of {blocks}/{p.blocks} blocks)" if blocks is not None else ")") if ckpt else "")
               + f", {margin:.0%} kept free")
    if cap == 0:
        return Fit(micro=0, checkpointing=False, memory_reason=why)
    micro = limit if cap is None else min(cap, limit)
    if o.micro_batch_cap is not None and (cap is None or o.micro_batch_cap < cap):
        why = f"micro-batch cap {o.micro_batch_cap} given ({why})"
    return Fit(micro=micro, checkpointing=ckpt, memory_reason=why, memory_cap=cap, checkpoint_blocks=blocks)


def does_not_fit(p: DeviceProfile, o: PlanOptions) -> tuple[str, str]:
    """Why a device cannot take one sample, and what would make it fit."""
    margin = o.memory_margin
    need = p.memory_needed(1)
    need_c = p.memory_needed(1, checkpointing=True)
    have = p.memory_bytes * (1 - margin)
    what = (f"{p.device}: one sample needs {format_bytes(need)} ({format_bytes(p.fixed_bytes)} model state "
            f"+ {format_bytes(need - p.fixed_bytes)} activations) but {format_bytes(have)} is usable "
            f"({format_bytes(p.memory_bytes)}, {margin:.0%} kept free)")
    if p.fixed_bytes >= have:
        fix = (f"the model state alone ({format_bytes(p.fixed_bytes)}: parameters, gradients, optimizer state) "
               f"exceeds it: shard it across devices (FSDP/ZeRO), use a smaller optimizer state, or a device "
               f"with ≥ {format_bytes(need_c / (1 - margin))}")
    elif o.allow_checkpointing:
        fix = (f"even with activation checkpointing it needs {format_bytes(need_c)}: a device with ≥ "
               f"{format_bytes(need_c / (1 - margin))}, a shorter sequence or smaller input, or sharding")
    else:
        fix = (f"activation checkpointing would need {format_bytes(need_c)}"
               + (" (fits)" if need_c <= have else "")
               + f"; or a device with ≥ {format_bytes(need / (1 - margin))}, or a smaller input")
    return what, fix


def ring_link(profiles: Sequence[DeviceProfile], o: PlanOptions) -> Link:
    """The ring's slowest link: as given, else the slowest of the devices' own links, else free."""
    if o.link is not None:
        return o.link
    given = [p for p in profiles if p.link_gbs]
    if given and len(given) == len(profiles):
        slow = min(given, key=lambda p: p.link_gbs)
        return Link(bandwidth_gbs=slow.link_gbs, source=f"slowest device link: {slow.device}'s")
    return FREE_LINK
