"""Memory savers of the data-parallel rows (pure): optimizer-state offload to host memory, where
and at what cost, and how each device's savers read in a row.

Which devices offload: the smallest cards first (least device memory; ties by rank), and only
as many as it takes to fit — the first count that fits, found by bisection over 0..W (fewer
offloaded hold more, so fitting grows with the count) — then the next kind of card too while
that makes the step more than 1% faster (FSDP2 and capacity-full: a card that can then hold whole
parameters accumulates instead of running one micro-batch). What they offload must fit the host's
memory (`PlanOptions.host_memory_bytes`, less the same margin the devices keep): the host holds
each offloading device's fp32 parameter slice and its optimizer state (memory.state_bytes).

What it costs, per step, added to that device's optimizer phase and overlapping nothing (the
update waits for the gradients, the next forward for the parameters):

    its gradient slice device→host and its updated parameters host→device, at the training
    precision, over its host link (PCIe: `host_link_gbs`), plus the host's optimizer step:
    the state read and written and the gradients read, Σ over every offloading device (they
    share the host's memory bandwidth) ÷ HOST_MEMORY_GBS.

Activation checkpointing per block count is the planner's (options.fit): the fewest blocks that
let one sample fit, on each device with the state this row gives it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dataclasses import replace

from ..errors import UsageError
from ..hardware.links import PCIE_GBS
from ..hardware.units import device_kinds, format_bytes
from .memory import capacity_fractions
from .options import fit
from .planner import make_plan

# A vectorised CPU Adam (DeepSpeed's CPUAdam, torch's foreach AdamW on CPU) is bound by memory
# bandwidth: one server socket's DDR4/DDR5 channels sustain tens of GB/s of it, well under their
# peak. 40 GB/s is that order, stated rather than measured: `hetrain plan` does not time a host step.
HOST_MEMORY_GBS = 40.0
# What `hetrain simulate` assumes per node without --host-memory: a common size for a 4-8 GPU
# server (the catalog has no host memory).
DEFAULT_HOST_MEMORY_PER_NODE = 256 * 2**30
FASTER = 0.01          # one more device offloads only when that makes the step this much faster


def host_link_gbs(profile) -> float:
    """The device's own link to host memory: its catalog PCIe generation, else PCIe 4.0 x16
    (≈ 24 GB/s effective, hardware/links.py)."""
    from ..hardware import catalog

    spec = catalog.lookup(profile.gpu) if profile.gpu else None
    return PCIE_GBS.get(spec.pcie_gen if spec else 4, PCIE_GBS[4])


def offload_seconds(moved_bytes: float, link_gbs: float, host_bytes_all: float, grads_all: float) -> float:
    """One offloading device's optimizer phase: `moved_bytes` each way over its link, then the
    host step over every offloading device's state (read and written) and gradients (read)."""
    return 2 * moved_bytes / (link_gbs * 1e9) + (2 * host_bytes_all + grads_all) / (HOST_MEMORY_GBS * 1e9)


def offload_order(profiles) -> list[int]:
    """Devices in the order they offload: least device memory first (uncapped ones never)."""
    return sorted((i for i, p in enumerate(profiles) if p.memory_bytes), key=lambda i: (profiles[i].memory_bytes, i))


def host_room(o) -> float:
    return 0.0 if o.host_memory_bytes is None else o.host_memory_bytes * (1 - o.memory_margin)


def fit_with_offload(attempt: Callable[[frozenset[int]], object], profiles, o,
                     host_bytes: Callable[[frozenset[int]], float], speed: Callable[[object], float]):
    """(result, offloaded, note) of the fewest smallest-first devices offloaded with which
    `attempt` (a plan with those offloaded; UsageError when it does not fit) succeeds, then the
    next kind's too while that is more than FASTER faster (`speed` of a result); raises the last
    UsageError, with why offloading did not help, when none does."""
    order = offload_order(profiles)
    sets = [frozenset(order[:j]) for j in range(len(order) + 1)]
    room = host_room(o)
    if o.offload == "all":
        if host_bytes(sets[-1]) > room:
            raise UsageError(f"offloading every device's optimizer state needs {format_bytes(host_bytes(sets[-1]))}"
                             f" of host memory, {format_bytes(room)} usable", "")
        return attempt(sets[-1]), sets[-1], ""
    try:
        return attempt(sets[0]), sets[0], ""
    except UsageError as e:
        first = e
    if o.offload == "none" or len(sets) == 1:
        raise first
    fits_host = [j for j in range(1, len(sets)) if host_bytes(sets[j]) <= room]
    if not fits_host:
        need = host_bytes(sets[1])
        where = ("host memory not known: give --host-memory" if o.host_memory_bytes is None else
                 f"{format_bytes(room)} of host memory usable")
        raise UsageError(f"{first.what}; offload: no host room for even {profiles[order[0]].device}'s optimizer "
                         f"state ({format_bytes(need)}, {where})", first.fix)
    top = fits_host[-1]
    try:
        best = (top, attempt(sets[top]))
    except UsageError as e:
        more = "" if top == len(sets) - 1 else f" (host memory holds the state of {top} of {len(sets) - 1})"
        raise UsageError(f"{e.what}; with the optimizer state of {device_kinds([profiles[i].device for i in sets[top]])}"
                         f" on host{more}", e.fix) from None
    lo, hi = 1, top
    while lo < hi:                 # the fewest that fit: bisection (more offloaded never need more memory)
        mid = (lo + hi) // 2
        try:
            best = (mid, attempt(sets[mid]))
            hi = mid
        except UsageError:
            lo = mid + 1
    j, result = best
    if j != lo:
        result = attempt(sets[lo])
    # More offloaded can still pay for itself where the fewest that fit leave a device unable to
    # accumulate (gathered state: it then runs one micro-batch): the rest of the next kind of
    # device (equal memory) at a time, kept while the step gets faster (at most one try a kind).
    while lo < top:
        nxt = lo + 1
        while nxt < top and profiles[order[nxt]].memory_bytes == profiles[order[nxt - 1]].memory_bytes:
            nxt += 1
        try:
            more = attempt(sets[nxt])
        except UsageError:
            break
        if speed(more) <= speed(result) * (1 + FASTER):
            break
        lo, result = nxt, more
    return result, sets[lo], f"offloaded because {first.what}"


def _usable(p, o) -> float:
    return p.memory_bytes * (1 - o.memory_margin) if p.memory_bytes else 2.0 ** 60


def _one_sample(p, o, room: float) -> float:
    """One sample's activations: without checkpointing where they fit `room`, else every block's."""
    act = p.memory_needed(1) - p.fixed_bytes
    if act <= room or not o.allow_checkpointing:
        return act
    return p.memory_needed(1, checkpointing=True) - p.fixed_bytes


def with_state(profiles, state, sharding: str, o, accumulating: frozenset[int],
                offload: frozenset[int] = frozenset()):
    w = len(profiles)
    fractions = [None] * w
    if sharding == "capacity-full":      # state in proportion to the room left by activations and gathered units
        room = []
        for i, p in enumerate(profiles):
            units = state.state(sharding, world_size=w, fraction=0.0, accumulates=i in accumulating,
                                offload=i in offload).total
            room.append(max(0.0, _usable(p, o) - units - _one_sample(p, o, _usable(p, o) - units)))
        fractions = list(capacity_fractions(room))
    if sharding == "capacity":
        whole = [state.state("none", world_size=1, offload=i in offload) for i in range(w)]
        free = [_usable(p, o) - _one_sample(p, o, _usable(p, o) - s.params - s.grads) - s.params - s.grads
                for p, s in zip(profiles, whole)]
        if max(free) <= 0:
            raise UsageError(f"whole parameters and gradients ({format_bytes(whole[0].params + whole[0].grads)}) and "
                             "one sample leave no device room for optimizer state", "")
        fractions = list(capacity_fractions(free))
    states = [state.state(sharding, world_size=w, fraction=fractions[i], accumulates=i in accumulating,
                          offload=i in offload) for i in range(w)]
    host_all = sum(states[i].host for i in offload)
    if host_all > host_room(o):
        raise UsageError(f"the optimizer state of {device_kinds([profiles[i].device for i in sorted(offload)])} "
                         f"needs {format_bytes(host_all)} of host memory, {format_bytes(host_room(o))} usable", "")
    owned = [state.trainable * state.device_param_bytes * (fractions[i] if fractions[i] is not None else
             1.0 if sharding == "none" else 1.0 / w) for i in range(w)]
    grads_all = sum(owned[i] for i in offload)
    return [replace(p, fixed_bytes=int(states[i].total), blocks=p.blocks or state.blocks,
                    optimizer_s=(offload_seconds(owned[i], host_link_gbs(p), host_all, grads_all)
                                 if i in offload else p.optimizer_s))
            for i, p in enumerate(profiles)]


def dp_plan(profiles, state, o, sharding: str, offload: frozenset[int], *, gathered: bool):
    """(plan, shaped profiles, capped ranks) for this sharding with these devices offloading.
    Gathered state: a rank that accumulates holds whole parameters (wrap.py); one that cannot
    hold them runs its share as one micro-batch (its share capped at the largest that fits with
    every block checkpointed), the others re-planned; then each capped share is planned again as
    it came out, so its device checkpoints only the blocks that share needs."""
    w = len(profiles)
    accumulating: frozenset[int] = frozenset()
    caps: dict[int, int] = {}

    def planned(shaped, caps):
        return make_plan(shaped, replace(o, allow_exclusion=False, offload_ranks=offload,
                                         share_caps=tuple(caps.get(i) for i in range(w)) if caps else ()))

    def one_micro(p) -> int:
        most = p.max_micro_batch(margin=o.memory_margin, checkpointing=o.allow_checkpointing)
        return max(1, min(most if most is not None else o.global_batch, o.micro_batch_cap or o.global_batch))

    for _ in range(w + 2):
        shaped = with_state(profiles, state, sharding, o, accumulating, offload)
        caps = {i: one_micro(shaped[i]) for i in caps}     # capacity-full's slices move with `accumulating`
        plan = planned(shaped, caps)
        if not gathered:
            return plan, shaped, frozenset()
        new = {d.rank for d in plan.devices if d.n_micro > 1} - accumulating - set(caps)
        if not new:
            break
        whole = with_state(profiles, state, sharding, o, accumulating | new, offload)
        for i in new:
            if fit(whole[i], o).micro == 0:
                caps[i] = one_micro(shaped[i])
            else:
                accumulating = accumulating | {i}
    if caps:       # the shares as they came out: no more checkpointing than they need
        tight = {i: plan.devices[i].share for i in caps}
        if tight != caps:
            plan = planned(shaped, tight)
    return plan, shaped, frozenset(caps)


def saver_cells(plan, profiles, offloaded: frozenset[int]) -> tuple[str, ...]:
    """Per device, the savers it uses ('ckpt 12/32, optim on host'; '' for none)."""
    out = []
    for i, d in enumerate(plan.devices):
        parts = []
        if d.checkpointing:
            n = profiles[i].blocks
            k = d.checkpoint_blocks if d.checkpoint_blocks is not None else n
            parts.append(f"ckpt {k}/{n}" if n else "ckpt all")
        if i in offloaded:
            parts.append("optim on host")
        out.append(", ".join(parts))
    return tuple(out)


def uses(cells: Sequence[str], devices: Sequence[str]) -> str:
    """'; savers: ckpt 12/32 on rtx3090#2, ...' for a row's detail ('' when none is used)."""
    groups: dict[str, list[str]] = {}
    for c, d in zip(cells, devices):
        if c:
            groups.setdefault(c, []).append(d)
    return "; savers: " + "; ".join(f"{c} on {device_kinds(ds)}" for c, ds in groups.items()) if groups else ""
