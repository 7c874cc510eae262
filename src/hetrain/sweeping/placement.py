"""Which trial goes where: pure (no processes, no Optuna), from the planner's memory model.

A trial's memory need is what `planning.memory.state_bytes` gives for its parameters, optimizer
and trainable count, plus its batch times its activation bytes per sample: the same model the
job planner sizes micro-batches with. A device fits a trial when that need is within its memory
less the job's margin (Memory.margin's default, 10%).

The rule, bigger trials on bigger cards: devices are ranked by memory, then speed. When devices
are free, the biggest free one is served first; the biggest card of the sweep takes the largest
queued trial that fits it, every other card the smallest queued trial that fits it, so a large
trial waits for the large card rather than filling a small one it barely fits, and a small card
keeps working on what only it should run. A trial that fits no single device may still fit a
group of them (groups.py: a data-parallel job whose state the memory model shards); one that fits
no group either is never queued: it fails with the reason (its need against the largest group's room).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.units import format_bytes
from ..planning.memory import state_bytes

MARGIN = 0.10      # fraction of a device's memory kept free, as Memory.margin's default


@dataclass(frozen=True, kw_only=True)
class Need:
    """One trial's memory need, and how it was found (for the table and the failure reason)."""

    bytes: float
    how: str
    # what the memory model needs to split the trial over a group (groups.py): params, batch,
    # act (bytes per sample), optimizer, trainable; None for a need given as bytes
    model: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One device of the sweep."""

    index: int
    label: str
    memory_bytes: int
    speed: float
    spec: str = ""        # on the CPU: the device as a cluster spec names it, for a group's job

    @property
    def room(self) -> float:
        return self.memory_bytes * (1 - MARGIN)


def need_of(spec: dict | None, *, where: str) -> Need:
    """A trial's need from what the objective's `memory(params)` returned: {"params": N,
    "batch": b, "activation_bytes_per_sample": a, "optimizer": "adamw", "trainable": T} (params
    required, the rest optional), or {"bytes": B} as measured elsewhere. None: no `memory`."""
    if spec is None:
        return Need(bytes=0.0, how="no memory(params): fits every device")
    if not isinstance(spec, dict):
        raise UsageError(f"{where} returned {type(spec).__name__}, not a dict",
                         'return e.g. {"params": 1_000_000, "batch": 32, "activation_bytes_per_sample": 2e5}')
    known = {"params", "batch", "activation_bytes_per_sample", "optimizer", "trainable", "bytes"}
    if unknown := sorted(set(spec) - known):
        raise UsageError(f"{where} returned unknown keys {unknown}", f"use only {sorted(known)}")
    if "bytes" in spec:
        return Need(bytes=float(spec["bytes"]), how=f"{format_bytes(spec['bytes'])} as given")
    if "params" not in spec:
        raise UsageError(f"{where} returned no 'params'", 'give the parameter count, e.g. {"params": 1_000_000}')
    params, batch = int(spec["params"]), int(spec.get("batch", 1))
    act = float(spec.get("activation_bytes_per_sample", 0.0))
    state = state_bytes(params, optimizer=spec.get("optimizer", "adamw"), trainable=spec.get("trainable")).total
    total = state + batch * act
    return Need(bytes=total, how=f"{format_bytes(state)} model state ({params:,} params) + {batch} x "
                                 f"{format_bytes(act)} activations = {format_bytes(total)}",
                model={"params": params, "batch": batch, "act": act, "optimizer": spec.get("optimizer", "adamw"),
                       "trainable": spec.get("trainable")})


def ranked(slots: Sequence[Slot]) -> list[Slot]:
    """Biggest first: memory, then speed, then the cluster's order."""
    return sorted(slots, key=lambda s: (-s.memory_bytes, -s.speed, s.index))


def fits_somewhere(need: Need, slots: Sequence[Slot]) -> str | None:
    """None when some device fits the trial; else the reason it fits none."""
    biggest = ranked(slots)[0]
    if need.bytes <= biggest.room:
        return None
    return (f"needs {format_bytes(need.bytes)} ({need.how}); the largest device, {biggest.label}, has room for "
            f"{format_bytes(biggest.room)} ({format_bytes(biggest.memory_bytes)} less {MARGIN:.0%})")


def assign(queued: Sequence[tuple[int, Need]], free: Sequence[Slot], slots: Sequence[Slot]) -> list[tuple[int, Slot]]:
    """(trial key, device) pairs for the free devices, by the rule above. `queued`: (key, need) of
    trials waiting, in the order they were asked; each is given at most once."""
    top = ranked(slots)[0].index
    waiting = list(queued)
    out = []
    for slot in ranked(free):
        fitting = [(key, need) for key, need in waiting if need.bytes <= slot.room]
        if not fitting:
            continue
        # stable: among equal needs the trial asked first
        pick = (max if slot.index == top else min)(fitting, key=lambda kn: kn[1].bytes)
        waiting.remove(pick)
        out.append((pick[0], slot))
    return out
