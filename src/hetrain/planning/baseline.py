"""Plain DDP with an equal split on the same devices: today's baseline, predicted by the same
cost model as hetrain's plan (planner.py puts the two side by side). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cost import Assignment, StepCost, step_cost
from .options import PlanOptions, ring_link
from .plan import split_evenly
from .profile import DeviceProfile


@dataclass(frozen=True, kw_only=True)
class DDPPrediction:
    """Plain DDP on every device: equal shares, one micro-batch size for all."""

    cost: StepCost | None            # None: it cannot run
    assignments: tuple[Assignment, ...]
    why: str


def ddp_equal_split(profiles: Sequence[DeviceProfile], o: PlanOptions) -> DDPPrediction:
    """Plain DDP on every device: equal shares, the same micro-batch everywhere (the smallest
    device's), no exclusions; checkpointing everywhere if a device needs it for one sample."""
    n = len(profiles)
    if o.global_batch < n:
        return DDPPrediction(cost=None, assignments=(), why=f"global batch {o.global_batch} < {n} devices")
    shares = split_evenly(o.global_batch, n)
    caps = [p.max_micro_batch(margin=o.memory_margin) for p in profiles]
    ckpt = False
    if any(c == 0 for c in caps) and o.allow_checkpointing:
        caps = [p.max_micro_batch(margin=o.memory_margin, checkpointing=True) for p in profiles]
        ckpt = True
    if any(c == 0 for c in caps):
        small = profiles[caps.index(0)].device
        return DDPPrediction(cost=None, assignments=(), why=(
            f"{small} cannot fit one sample, and plain DDP runs the same batch on every device"))
    micro = min([shares[0]] + [c for c in caps if c is not None]
                + ([o.micro_batch_cap] if o.micro_batch_cap else []))
    assignments = tuple(Assignment(profile=p, share=s, micro_batch=min(micro, s), checkpointing=ckpt)
                        for p, s in zip(profiles, shares))
    cost = step_cost(assignments, global_batch=o.global_batch, grad_bytes=o.grad_bytes,
                     link=ring_link(profiles, o), sync_s=o.sync_s if n > 1 else None)
    why = (f"{shares[0]} samples per device in micro-batches of {micro} (the smallest device's)"
           + (" with activation checkpointing" if ckpt else "")
           + f", so every step waits for {profiles[cost.bottleneck].device}")
    return DDPPrediction(cost=cost, assignments=assignments, why=why)
