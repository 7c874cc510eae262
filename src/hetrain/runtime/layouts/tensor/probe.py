"""`hetrain plan` only: a tensor-parallel step on this job's devices and backend, measured.

The ranking's TP rows (planning/ranking.py, runtime/layouts/tensor/split.py) cost each rank its part of
the model's compute and the activations' all-reduces over the link. On gloo (CPU devices) that is
far from what a TP step takes: every layer's forward and backward waits in the calling thread for
an all-reduce, the sharded layers run smaller matrix products than the whole model's profile was
timed on, and the uneven split's bookkeeping is CPU time that a device pacing its CPU time pays.
Measured on the demo GPT (4 blocks of d=128, 2 ranks at speeds 1
and 0.67, 64 samples a step, a 2-core EPYC): the modelled split by speed read 286 samples/s, the
run 113. So `hetrain plan` times it, as it times FSDP2 (fsdp_probe.py):

    seconds a micro-batch of forward + backward, and an optimizer step, of the model split by speed

and what each rank holds then (its shards' state, and the activations its forward saves: the
allocator's peak over the forward on CUDA, the saved tensors elsewhere, as the profiler counts
them), on a copy sharded as the runtime shards it (runtime/layouts/tensor.wrap:
layouts/tensor/shard.shard by the devices' speeds), every rank the same rows (the caller passes the
micro-batch the runtime will run: runtime/layouts/tensor/split.tp_micro_batch), each rank's
compute run as in training (through a fresh pace of the device's own, told the rank's share of the
model's compute: devices/measuring.Pace), from a barrier to a barrier (the slowest rank
sets it). The job's own model is left as it was. The even split (DTensor) is not timed: the row
split by speed is the one TP is asked for on mixed devices.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ...devices import clock as clocks
from ...devices.precision_policy import DTYPES
from ...user_objects import rows as batch_rows
from ...devices.measuring import DeviceMeasuring
from ...measure.fsdp_probe import paced_by, paced_forward_backward, paced_optimizer_step, stateless
from ...devices.saved_bytes import SavedBytes, model_state_bytes

# Timed steps, after one warm-up (the median kept). 8, as the pipeline probe; not what steadies
# TP's figure: two sets of four plans of the dilated pair (2-core EPYC, wall clock) read the TP
# row 3.3% and 13.5% apart with 4, five plans 14.4% with 8 (one of them 8% above the rest).
RUNS = 8


def time_tp_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, *, forward: Callable,
                 device: torch.device, precision: str, speeds: Sequence[float],
                 measuring: DeviceMeasuring | None = None, runs: int = RUNS) -> dict:
    """A step of the model split by `speeds` over the job's ranks (a collective: every rank calls
    it with the same model and its own batch of the same rows). Returns {"fb_s" (forward +
    backward, the slowest rank), "opt_s" (the optimizer step), "runs", "micro_batch", "memory"
    (every rank's [state bytes, activation bytes] at those rows, in rank order)}, each rank's
    compute through a fresh pace of its device (`measuring`: DeviceHooks.measuring; None: as it
    comes). Raises
    UsageError where the model has no layers to split (the caller skips TP then)."""
    from .shard import compute_share, rebuild, shard

    dtype = DTYPES.get(precision)
    cuda = device.type == "cuda"
    sharded = copy.deepcopy(model)
    names = {p: n for n, p in model.named_parameters()}
    done = shard(sharded, speeds=list(speeds))
    new = dict(sharded.named_parameters())
    opt = rebuild(stateless(optimizer), {p: [new[m] for m in done.renamed.get(n, (n,))] for p, n in names.items()})
    own = paced_by(measuring)
    own.sharded(compute_share(sharded))       # this rank's part of the model, as tensor/loop.py tells the hooks
    rows = batch_rows(batch) or 1

    counter = SavedBytes(sharded)

    def saved(run: Callable[[], None]) -> float:
        """Bytes the forward inside `run` keeps for backward, counted as the profiler counts them."""
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            run()
            return float(torch.cuda.max_memory_allocated(device) - base)
        with counter.forward():
            run()
        return float(counter.activations)

    def step(count: bool = False) -> tuple[float, float, float]:
        dist.barrier()
        t0 = clocks.host()
        act = 0.0
        # paced as training paces it (devices/hooks.py): before the backward, the backward's CPU
        # beyond its guess paid with the optimizer's
        def run() -> None:
            paced_forward_backward(sharded, batch, forward=forward, device=device, dtype=dtype, pace=own, rows=rows)
        if count:
            act = saved(run)
        else:
            run()
        clocks.synchronize(device)
        dist.barrier()
        t1 = clocks.host()
        paced_optimizer_step(opt, own, device)
        dist.barrier()
        return t1 - t0, clocks.host() - t1, act

    with torch.random.fork_rng(devices=[device] if cuda else []):
        act = step(count=True)[2]              # warm-up: the optimizer's state; what the forward saves
        times = [step() for _ in range(runs)]
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, [float(model_state_bytes(sharded, opt)), act])
    return {"fb_s": statistics.median(t[0] for t in times), "opt_s": statistics.median(t[1] for t in times),
            "runs": runs, "micro_batch": rows, "memory": held}
