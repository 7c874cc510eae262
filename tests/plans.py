"""Fixed Plans for the multi-process tests that are not about measuring.

A job given a Plan (`hetrain.init(plan=...)` or `prepare(parallel=plan)`) skips the profiler and
the sync probes, ~10 s of CPU a job on a 2-core host, so only the tests of measuring measure.
The shares come from the pure planner's split of the batch by speed (planning/memory.py's
partition_bounds, as the planner splits it); nothing here times anything. Plans are frozen, so
each is built once a session and shared.
"""

from __future__ import annotations

from functools import lru_cache

from hetrain.planning.memory import partition_bounds
from hetrain.planning.plan import DevicePlan, Plan


def by_speed(global_batch: int, speeds) -> tuple[int, ...]:
    """`global_batch` split in proportion to `speeds`, as the planner splits it."""
    bounds = partition_bounds(global_batch, list(speeds))
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


@lru_cache(maxsize=None)
def data_plan(shares: tuple[int, ...], micros: tuple[int, ...] | None = None, *,
              speeds: tuple[float, ...] | None = None, names: tuple[str, ...] | None = None,
              caps: tuple[int, ...] | None = None) -> Plan:
    """A data-parallel Plan: rank r computes shares[r] samples in micro-batches of micros[r]
    (default: one micro-batch), on a device named names[r] (default cpu<r>) of caps[r] bytes
    (default: not known)."""
    w = len(shares)
    micros = micros or shares
    speeds = speeds or (1.0,) * w
    names = names or tuple(f"cpu{r}" for r in range(w))
    caps = caps or (None,) * w
    devices = tuple(DevicePlan(rank=r, device=names[r], speed=speeds[r], share=shares[r], micro_batch=micros[r],
                               memory_cap_bytes=caps[r]) for r in range(w))
    return Plan(global_batch=sum(shares), devices=devices)


@lru_cache(maxsize=None)
def speed_plan(global_batch: int, speeds: tuple[float, ...], micro: int | None = None) -> Plan:
    """A data-parallel Plan with the batch split by `speeds`, each share in micro-batches of at
    most `micro` (default: one micro-batch)."""
    shares = by_speed(global_batch, speeds)
    return data_plan(shares, tuple(min(s, micro or s) for s in shares), speeds=tuple(speeds))


@lru_cache(maxsize=None)
def tp_plan(global_batch: int, speeds: tuple[float, ...], split: str = "even", micro: int | None = None) -> Plan:
    """A tensor-parallel Plan over every rank: each computes the whole batch in micro-batches of
    `micro` (default: one), its layers cut by `speeds` under split='speed'."""
    from hetrain.layout_spec import TensorParallel, to_spec

    devices = tuple(DevicePlan(rank=r, device=f"cpu{r}", speed=v, share=global_batch,
                               micro_batch=micro or global_batch) for r, v in enumerate(speeds))
    return Plan(global_batch=global_batch, devices=devices, layout="tp", group=len(speeds),
                layout_spec=to_spec(TensorParallel(split=split)))
