"""Trials over a group of devices: pure (no processes, no Optuna), from the planner's memory model.

A trial too big for one card runs as a hetrain data-parallel job over several. What each member
holds is `planning.memory.sharding_options` for the trial's parameters, with each member's
activations at its share of the trial's batch (shares in proportion to speed, as hetrain's
planner gives them), and the sharding is the planner's choice (`choose_sharding`: none, zero1,
capacity, fsdp, the first that fits every member). Only a need given as a model (`params`,
`batch`, `activation_bytes_per_sample`) can be split; one given as `bytes` cannot.

Which group: among the free devices, the fewest that hold the trial, then the least memory
between them (bigger cards stay free for what only they hold), then the fastest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from ..errors import UsageError
from ..hardware.units import format_bytes
from ..planning.memory import DeviceMemory, choose_sharding, sharding_options
from .placement import MARGIN, Need, Slot, ranked

MAX_GROUP = 8        # members of a group searched (2..8 of the free devices)


@dataclass(frozen=True, kw_only=True)
class GroupFit:
    members: tuple[Slot, ...]
    sharding: str
    peaks: tuple[float, ...]      # bytes per member under that sharding
    why: str                      # the memory model's reason for the sharding

    @property
    def label(self) -> str:
        return " + ".join(s.label for s in self.members)


def _members_memory(need: Need, members: Sequence[Slot]) -> list[DeviceMemory]:
    speed = sum(s.speed for s in members)
    return [DeviceMemory(label=s.label, capacity=s.room,
                         activations=need.model["batch"] * s.speed / speed * need.model["act"]) for s in members]


def _options(need: Need, members: Sequence[Slot]):
    m = need.model
    return sharding_options(m["params"], _members_memory(need, members), optimizer=m["optimizer"],
                            trainable=m["trainable"])


def group_fit(need: Need, members: Sequence[Slot]) -> GroupFit | None:
    """How `members` hold the trial together, or None when they cannot (or it cannot be split)."""
    if need.model is None or len(members) < 2:
        return None
    devices = _members_memory(need, members)
    try:
        option, why = choose_sharding(_options(need, members), devices)
    except UsageError:
        return None
    return GroupFit(members=tuple(members), sharding=option.strategy, peaks=option.peak, why=why)


def best_group(need: Need, free: Sequence[Slot]) -> GroupFit | None:
    """The group of free devices to run the trial on, by the rule above; None when none holds it."""
    free = ranked(free)
    for size in range(2, min(len(free), MAX_GROUP) + 1):
        fits = [f for members in combinations(free, size) if (f := group_fit(need, members)) is not None]
        if fits:
            return min(fits, key=lambda f: (sum(s.memory_bytes for s in f.members), -sum(s.speed for s in f.members)))
    return None


def fits_no_group(need: Need, slots: Sequence[Slot]) -> str:
    """Why no group of `slots` holds the trial: its need and the largest group's room."""
    members = ranked(slots)[:MAX_GROUP]
    room = sum(s.room for s in members)
    whole = f"the largest group, {len(members)} device(s) ({', '.join(s.label for s in members)}), has room for " \
            f"{format_bytes(room)} together ({MARGIN:.0%} of each kept free)"
    if need.model is None:
        return (f"needs {format_bytes(need.bytes)} ({need.how}), given as bytes, which a group cannot split; {whole}; "
                "memory() must give params, batch and activation_bytes_per_sample for a trial over several devices")
    if len(members) < 2:
        return f"needs {format_bytes(need.bytes)} ({need.how}); {whole}"
    devices = _members_memory(need, members)
    best = max(_options(need, members), key=lambda o: o.headroom(devices))
    fullest = min(range(len(members)), key=lambda r: (devices[r].capacity - best.peak[r]) / devices[r].capacity)
    return (f"needs {format_bytes(need.bytes)} ({need.how}); {whole}, and under its best sharding, {best.strategy}, "
            f"{members[fullest].label} would hold {format_bytes(best.peak[fullest])} of its "
            f"{format_bytes(devices[fullest].capacity)}")
