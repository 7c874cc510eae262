"""`hetrain plan` only: what FSDP2 adds to a step on this job's devices and backend, measured.

The ranking's FSDP2 row (planning/ranking.py) is plain DP's step plus FSDP2's collectives: an
all-gather of every unit before its forward and again before its backward, and a reduce-scatter
of its gradients. On NCCL the gathers are prefetched under compute on their own stream, and the
bytes model holds. On gloo (CPU devices) nothing overlaps: every collective is waited for in the
calling thread, costs gloo's ~1-2 ms latency, and FSDP2's own work around it (copy-in, copy-out,
DTensor bookkeeping, hooks) is CPU time, which a device that paces its CPU time pays like any
compute. Measured on the demo GPT (4 blocks, 2 ranks, 16 samples
each, a 2-core EPYC): a step 1.48x DDP's (+30 ms CPU, +35 ms waiting), where the bytes model
gave +1%. No formula here would hold across hosts, so `hetrain plan` times it:

    excess = median over runs of (an FSDP2 step − the DDP step beside it)

both on each rank's micro-batch of the data-parallel plan the row adds the excess to (the
caller's batch, runtime/layouts/ranking.py: with uneven rows every unit's collectives hold the
ranks to the one with the most CPU a unit, while each device paces its own, so the excess depends
on the shares), forward + backward, each rank's compute run as in training (through a fresh pace
of the device's own, devices/measuring.Pace: what the device's time adds to its CPU's, or nothing
on a GPU), from a barrier to a barrier (the slowest rank sets both). The model is wrapped as the
runtime wraps it
(runtime/sharding/wrap.py: each block reshards after forward, the root does not), on a copy: the
job's own model is left as it was. The excess is per step: FSDP2's collectives run once a step
whatever the micro-batch (a rank that accumulates gathers once and keeps the units, wrap.py).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..devices import clock as clocks
from ..devices.precision_policy import DTYPES
from ..user_objects import as_scalar, rows as batch_rows
from ..devices.measuring import DeviceMeasuring, Pace

# Timed steps of each wrapper, alternating (after one warm-up of each). With 5 and a difference of
# medians, four `hetrain plan` runs of the dilated pair (2-core EPYC, wall clock) put the FSDP2
# row at 100-119 samples/s (spread 17%); with 9 and the pairs' median difference, 109-114 (5%).
RUNS = 9


def time_fsdp_excess(model: torch.nn.Module, optimizer: torch.optim.Optimizer, blocks: list[str], batch, *,
                     forward: Callable, device: torch.device, precision: str,
                     measuring: DeviceMeasuring | None = None, runs: int = RUNS) -> dict:
    """Seconds an FSDP2 step takes beyond a DDP step, on this job (a collective: every rank calls
    it with the same model, `blocks`: the dotted names of the blocks FSDP2 shards one by one).
    Each runs on its own copy of the model with its own copy of the optimizer (the same class and
    settings, fresh: its first step, untimed, makes its state), forward, backward and optimizer
    step, through a fresh pace of the device (`measuring`: the device's, DeviceHooks.measuring;
    None: run as it comes). Returns {"excess_s", "fsdp_s", "ddp_s", "runs", "micro_batch"}."""
    from ..sharding.wrap import rebuild_optimizer, shard_blocks

    dtype = DTYPES.get(precision)
    cuda = device.type == "cuda"
    sharded, plain = copy.deepcopy(model), copy.deepcopy(model)
    shard_blocks(sharded, [sharded.get_submodule(name) for name in blocks], device=device,
                 world_size=dist.get_world_size())
    ddp = DDP(plain, device_ids=[device.index] if cuda else None)
    # No buffer broadcast in the timed forwards. Set as an attribute, as sync_probes.py does: the
    # keyword warns (deprecated) on torch 2.13, and every rank's copy is the same model anyway.
    ddp.broadcast_buffers = False
    names = {p: n for n, p in model.named_parameters()}
    fresh = stateless(optimizer)
    runs_on = []
    for copied in (plain, sharded):
        new = dict(copied.named_parameters())
        runs_on.append(rebuild_optimizer(fresh, {p: new[n] for p, n in names.items()}, who="the FSDP2 probe"))

    rows = batch_rows(batch) or 1
    # each wrapper its own books of the device (the backward's learned length, the debt)
    paces = [paced_by(measuring) for _ in range(2)]

    def step(module, opt, own) -> float:
        dist.barrier()
        t0 = clocks.host()
        # paced as training paces it (devices/hooks.py): before the backward, the backward's and
        # the rest's CPU paid with the optimizer's; the collectives' waits on top
        paced_forward_backward(module, batch, forward=forward, device=device, dtype=dtype, pace=own, rows=rows)
        paced_optimizer_step(opt, own, device)
        dist.barrier()
        return clocks.host() - t0

    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            step(ddp, runs_on[0], paces[0]), step(sharded, runs_on[1], paces[1])    # warm-up: buckets, lazy init, state
            times = [(step(ddp, runs_on[0], paces[0]), step(sharded, runs_on[1], paces[1])) for _ in range(runs)]
    finally:
        del ddp, sharded, plain, runs_on
        gc.collect()
    ddp_s = statistics.median(t[0] for t in times)
    fsdp_s = statistics.median(t[1] for t in times)
    return {"excess_s": paired_excess(times), "fsdp_s": fsdp_s, "ddp_s": ddp_s, "runs": runs, "pairs": times,
            "micro_batch": batch_rows(batch)}


def paired_excess(pairs) -> float:
    """Seconds an FSDP2 step takes beyond a DDP step from (DDP, FSDP2) pairs run back to back: the
    median of each pair's difference (at least 0). A host phase that slows one step slows its
    partner too and cancels; a difference of the two medians keeps it."""
    return max(0.0, statistics.median(f - d for d, f in pairs))


def paced_forward_backward(module, batch, *, forward: Callable, device: torch.device, dtype, pace: Pace,
                           rows: int) -> None:
    """One forward and backward as the engine runs them: under the autocast of `dtype`, through
    the device's `pace` as devices/hooks.py places it (Pace.before_backward with the forward's CPU
    for `rows` samples, Pace.after_backward with the backward's), the backward's error owed to the
    next settle; whatever waits inside come on top."""
    c0 = clocks.thread_cpu()
    with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
        loss = as_scalar(forward(module, batch))
    forward_cpu = clocks.thread_cpu() - c0
    guess = pace.before_backward(forward_cpu, samples=rows)
    c0 = clocks.thread_cpu()
    loss.backward()
    pace.after_backward(forward_cpu, guess, clocks.thread_cpu() - c0)


def paced_optimizer_step(optimizer: torch.optim.Optimizer, pace: Pace, device: torch.device) -> None:
    """The optimizer step as training paces it (devices/hooks.py: under the pace's compute(),
    which also pays what the backward still owes), gradients cleared, the device synchronized."""
    with pace.compute():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clocks.synchronize(device)


def paced_by(measuring) -> Pace:
    """A fresh pace of the device `measuring` states; as it comes where none is given."""
    return measuring.pace() if measuring is not None else Pace()


def stateless(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer like this one with no state (rebuild_optimizer wants a fresh one): profiling
    may have stepped the job's own."""
    if not optimizer.state:
        return optimizer
    twin = copy.copy(optimizer)
    twin.state = type(optimizer.state)()
    return twin
