"""When no layout fits: what would make one fit, in numbers (pure).

The memory savers come first, when one is turned off or short of room (they cost the least:
no devices, no change to the job): activation checkpointing, and optimizer-state offload — its
fully sharded figure, what each device would still hold, and the host memory it needs.

Then each answer changes one thing and solves for it, on the device with the least usable memory
(every layout below needs each device to hold its part, so that device decides):

  * the global batch: FSDP2 stays fully sharded only while every device runs its share as one
    micro-batch (a rank that accumulates holds whole parameters: runtime/sharding/wrap.py), so
    the largest batch at which every device takes its share at once;
  * more devices: fully sharded state falls as 1/W, the two units in flight and one sample's
    activations do not; W' = ⌈state / (usable − units − activations)⌉;
  * fewer trainable parameters: DP holds P frozen weights plus (2·p + k·s − f) bytes per trainable
    one (its weight, gradient, optimizer state, less the frozen copy it replaces); the largest T
    that leaves one sample's activations room;
  * more memory: what one device needs for plain DP.
"""

from __future__ import annotations

import math

from ..hardware.units import format_bytes
from .memory import state_values
from .savers import host_room


def _smallest(profiles, margin: float):
    capped = [p for p in profiles if p.memory_bytes]
    if not capped:
        return None, math.inf
    p = min(capped, key=lambda p: p.memory_bytes)
    return p, p.memory_bytes * (1 - margin)


def _activations(p, *, checkpointing: bool) -> float:
    return p.memory_needed(1, checkpointing=checkpointing) - p.fixed_bytes


def what_would_fit(profiles, state, options) -> list[str]:
    margin, w = options.memory_margin, len(profiles)
    small, usable = _smallest(profiles, margin)
    if small is None:
        return []
    ckpt = options.allow_checkpointing
    act = _activations(small, checkpointing=ckpt)
    out = []
    full = state.state("fsdp", world_size=w, accumulates=False)
    sharded = full.params + full.grads + full.optimizer
    if not ckpt:
        out.append("activation checkpointing (--checkpointing plan) keeps a fraction of the activations")
    off = state.state("fsdp", world_size=w, offload=True)
    host_need = state.state("fsdp", world_size=1, offload=True).host
    if options.offload == "none":
        out.append(f"optimizer-state offload to host memory (--offload plan): fully sharded, each device then holds "
                   f"{format_bytes(off.total)} of model state instead of {format_bytes(full.total)}, the host "
                   f"{format_bytes(host_need)}")
    elif host_room(options) < host_need:
        out.append(f"host memory for the optimizer state (--host-memory, per node): offloaded and fully sharded it "
                   f"needs {format_bytes(host_need)}, {format_bytes(host_room(options))} usable")
    # FSDP2 at one micro-batch per device: each device's share capped by its own memory (its
    # optimizer state on host where the host has room for every device's).
    hosted = options.offload != "none" and host_room(options) >= host_need
    held = off.total if hosted else sharded + full.transient
    caps = []
    for p in profiles:
        room = (p.memory_bytes * (1 - margin) if p.memory_bytes else math.inf) - held
        per = _activations(p, checkpointing=ckpt)
        caps.append(math.inf if not p.memory_bytes else max(0, int(room // per)) if per > 0 else math.inf)
    if all(c >= 1 for c in caps) and w > 1:
        most = sum(caps)
        if math.isfinite(most) and most < options.global_batch:
            out.append(f"FSDP2 fits with a global batch of at most {most} (each device runs its share as one "
                       "micro-batch, so it stays fully sharded; accumulating micro-batches holds whole parameters)"
                       + (", its optimizer state on host" if hosted else ""))
    # More devices like the smallest.
    whole = state.state("fsdp", world_size=1, accumulates=False)
    total = whole.params + whole.grads + whole.optimizer
    room = usable - full.transient - act
    if room > 0:
        need = math.ceil(total / room)
        if need > w:
            out.append(f"FSDP2 fits on {need} devices with {format_bytes(usable)} usable each (now {w}): the "
                       f"state ({format_bytes(total)}) shards 1/W, {format_bytes(full.transient)} of units in "
                       f"flight and {format_bytes(act)} of one sample's activations do not")
    else:
        out.append(f"even fully sharded over any number of devices, two blocks in flight and one sample "
                   f"({format_bytes(full.transient + act)}) exceed {small.device}'s {format_bytes(usable)}: "
                   "a shorter sequence, smaller blocks, or a device with more memory")
    # Fewer trainable parameters (fine-tuning), plain DP; a frozen base kept in bf16 (2 bytes).
    base = min(state.frozen_param_bytes, 2.0)
    frozen = state.params * base
    per_trainable = 2 * state.param_bytes + 4 * state_values(state.optimizer) - base
    most_trainable = int((usable - act - frozen) // per_trainable) if per_trainable > 0 else 0
    if 0 < most_trainable < state.trainable:
        out.append(f"DP fits when at most {most_trainable:,} of the {state.params:,} parameters train and the "
                   "frozen rest is kept in bf16 (--trainable-params N, or --lora RANK on a preset; in code: "
                   "requires_grad=False on the rest)")
    elif most_trainable <= 0:
        out.append(f"the weights alone ({format_bytes(frozen)} at {base:g} bytes each) and one sample exceed "
                   f"{small.device}'s {format_bytes(usable)}: fine-tuning cannot make DP fit; a frozen base in "
                   "8-bit, or sharding over more devices")
    need = state.state("none", world_size=1).total + act
    out.append(f"plain DP needs {format_bytes(need / (1 - margin))} per device "
               f"({format_bytes(need)} used, {margin:.0%} kept free); {small.device} has "
               f"{format_bytes(small.memory_bytes)}")
    return out
