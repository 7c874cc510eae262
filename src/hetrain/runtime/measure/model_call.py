"""Whether hetrain can call the user's model itself, and the plan it starts from when it cannot.

Planning measures the model before training, calling it on a batch of the data with
`forward(model, batch)` (runtime/user_objects.py). Some models are called otherwise (a forward of
several arguments, `model(input, target)`; a batch the call does not know how to pass), and only
the user's loop knows how. Then hetrain plans from that loop instead of failing: `probe` finds out
on every rank, with one forward and backward of two samples that leave nothing behind (the call
the profiler would make first); where any rank's call fails, every rank starts from
`unmeasured_plan`: shares by the catalog's speeds (the device's speed as its catalog entry or spec
gives it, else a GPU's peak FLOP/s in the precision it computes in; an even split where a rank has none), each share in one
micro-batch unless Memory(max_micro_batch=) caps it (an OOM halves it, as in any step). The
rebalancer then re-plans from the device times the user's first steps measure
(resilience/rebalance.py's FirstSteps), as the profile would have planned them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...planning.memory import partition_bounds
from ...planning.plan import DevicePlan, Plan
from ..loop.flops import local_peak
from ..sharding.fsdp_guard import one_step
from ..user_objects import ForwardCallError

UNMEASURED = "not measured"     # how the plan's note and reasons begin


def probe(job, model, forward) -> str | None:
    """None where every rank called the model; else the first failing rank's error, the same on
    every rank. Sets job.unmeasured to it. Collective."""
    model.to(job.device)
    batch = job.load(range(min(2, len(job.dataset))))
    error, oom = None, False
    try:
        one_step(model, batch, forward=forward, autocast=lambda: job.precision.autocast(job.device.type),
                 device=job.device)
    except torch.OutOfMemoryError:
        oom = True            # callable: measuring says what fits
    except Exception as e:    # noqa: BLE001 — any failure of the call: the user's loop knows how
        cause = e.__cause__ if isinstance(e, ForwardCallError) and e.__cause__ is not None else e
        text = str(cause).splitlines()[0][:160] if str(cause) else ""
        error = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
    if oom:                   # outside the except block: its traceback held the failed graph
        model.zero_grad(set_to_none=True)
        if job.device.type == "cuda":
            torch.cuda.empty_cache()
    facts = (error, catalog_rate(job), job.device_label, job.precision.name)
    every = [facts]
    if job.world_size > 1:
        every = [None] * job.world_size
        dist.all_gather_object(every, facts)
    job.unmeasured_facts = every
    failed = [(r, e) for r, (e, *_rest) in enumerate(every) if e]
    job.unmeasured = None if not failed else f"rank {failed[0][0]} could not call the model ({failed[0][1]})"
    return job.unmeasured


def catalog_rate(job) -> float | None:
    """This rank's speed by the catalog: the one its device's spec gives, or its peak FLOP/s."""
    given = job.hooks.given_device()
    return given[0] if given is not None else local_peak(job)


def unmeasured_plan(job) -> Plan:
    """Shares by the catalog's speeds (even where one is missing), each in one micro-batch (or
    the configured cap); the same on every rank (from probe's gathered facts)."""
    cfg, every = job.config, job.unmeasured_facts
    rates = [rate for _, rate, _, _ in every]
    known = all(r and r > 0 for r in rates)
    rates = [r / max(rates) for r in rates] if known else [1.0] * len(every)
    bounds = partition_bounds(cfg.global_batch, rates)
    shares = [max(1, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    cap = cfg.memory.max_micro_batch
    why = "the catalog's speeds" if known else "an even split (no catalog speed for every device)"
    devices = tuple(
        DevicePlan(rank=r, device=label, speed=rate, share=s, micro_batch=min(s, cap or s), precision=precision,
                   reasons=(f"share {s}/{cfg.global_batch}: {UNMEASURED}, {why}",
                            "micro-batch: the whole share" + (f", capped at {cap}" if cap else "") +
                            " (an out-of-memory halves it)"))
        for r, ((_, _, label, precision), rate, s) in enumerate(zip(every, rates, shares)))
    note = (f"{UNMEASURED}: {job.unmeasured}; started from {why}, re-planned from the device times of the first "
            "steps")
    return Plan(global_batch=cfg.global_batch, devices=devices, note=note)
