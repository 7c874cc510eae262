"""Data parallelism (and tensor parallelism, which runs the same loop): every rank runs its own
micro-batches through the whole model (DDP, FSDP2 or ZeRO under runtime/sharding/), or, under TP,
every rank of the group runs the same micro-batches through its shards of every layer.

The rank's pass over its micro-batches: the last one syncs gradients (DDP all-reduces exactly
once per step: every micro-batch but the last runs under no_sync(), forward included — with
backward alone inside no_sync, DDP syncs every micro-batch and unequal counts deadlock). An OOM
is handled as runtime/resilience/oom.py describes: redone locally before the sync, or, inside it,
the sync completed with zeros and the step redone by every rank.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ...errors import UsageError
from ...planning.plan import split_evenly
from ..loop.steps import MicroBatch
from ..resilience import oom as recovery


class DataLayout:
    """parallel='dp': the user's model on every rank; gradients synchronised by job.sync."""

    name = "dp"
    deferred = False          # the user's backward() runs at once (pipelines record it instead)

    def __init__(self, loss_fn=None):
        self.loss_fn = loss_fn

    # -- the loop -------------------------------------------------------------------------------
    def loss(self, job, mb: MicroBatch) -> torch.Tensor:
        """`loss_fn(model(inputs), targets)` under this rank's autocast (ht.loss)."""
        inputs, targets = inputs_and_targets(mb.batch, self.name)
        with job.precision.autocast(job.device.type):
            return self.loss_fn(job.model(inputs), targets)

    def reports_loss(self, job) -> bool:
        """Does this rank's loss and sample count go into the step's totals? (Each sample once.)"""
        return True

    def rank_pass(self, loop, state):
        """This rank's micro-batches of the step (a generator the user's `for mb in step` drives);
        returns 'ok', 'desync' (agreed next: every rank redoes the step) or 'fatal'."""
        job, hooks, step = loop.job, loop.job.hooks, state.step
        share = job.plan.devices[job.rank].share
        while True:
            hooks.attempt_start()
            if job.guard is not None:        # FSDP2's collectives start with the first micro-batch
                job.guard.start_attempt()
            state.count = torch.zeros((), dtype=torch.float64, device=job.device)
            state.loss_sum = torch.zeros((), dtype=torch.float64, device=job.device)
            sizes = split_evenly(share, math.ceil(share / state.micro))
            failed = None
            chunks = chunked(step.indices, sizes)
            for k, (size, chunk, batch) in enumerate(zip(sizes, chunks, job.read(chunks))):
                mb = MicroBatch(batch=batch, size=size, index=k, count=len(sizes), indices=chunk,
                                catch_oom=job.config.memory.oom_recovery)
                state.mb = mb
                if mb.last and job.guard is not None:
                    job.guard.begin()
                sync = contextlib.nullcontext() if mb.last or job.sync is None else job.sync.no_sync()
                hooks.micro_batch_start(mb, step.index)
                with sync:
                    yield mb
                hooks.micro_batch_end(mb)
                if mb.failed is not None:
                    failed = mb
                    break
                if not mb.backward_done:
                    raise UsageError(f"micro-batch {k} of step {step.index} ended without ht.backward(loss)",
                                     "call ht.backward(loss) once inside every micro-batch")
            state.mb = None
            if failed is None:
                return "ok"
            outcome = self._after_oom(job, state, failed)
            if outcome is not None:
                return outcome

    def _after_oom(self, job, state, failed: MicroBatch) -> str | None:
        """This rank ran out of memory: 'fatal', 'desync' (agreed next), or None (redo locally)."""
        job.run.ooms += 1
        job.hooks.attempt_failed()
        smaller = recovery.smaller_micro_batch(state.micro)
        owes = job.guard is not None and not failed.desynced and (job.guard.every_oom_desyncs or smaller is None)
        if owes:
            # The step is abandoned: its gradients go before the zeros that settle the peers come
            # (the failed graph went with the micro-batch: the `with mb:` block and backward()).
            job.optimizer.zero_grad(set_to_none=True)
            recovery.free_cached(job.device)
        if owes and job.guard.every_oom_desyncs:
            job.guard.complete_missing()    # FSDP2: peers wait in this step's collectives (fsdp_guard.py)
            failed.desynced = True
        job.log.warn(f"{job.device_label}: out of memory in micro-batch "
                     f"{failed.index + 1}/{failed.count} ({failed.failed}) of step {state.step.index}; "
                     + (f"micro-batch {state.micro} -> {smaller}, redoing" if smaller else "cannot shrink"))
        if smaller is None:
            if not failed.desynced and job.guard is not None:   # peers wait in this step's sync: join it
                job.guard.begin()
                job.guard.complete_missing()
            return "fatal"
        state.micro = smaller
        if failed.desynced:
            return "desync"
        job.optimizer.zero_grad(set_to_none=True)
        recovery.free_cached(job.device)
        # The failed forward may have run DDP's pre-forward buffer broadcast (it does, in a
        # step's first forward) without its post-forward: the redo must not broadcast again,
        # or this rank would be one collective ahead of its peers.
        if hasattr(job.sync, "require_forward_param_sync"):
            job.sync.require_forward_param_sync = False
        return None

    def redo(self, job) -> None:
        """Every rank agreed to redo the step (an OOM broke a gradient sync)."""
        job.optimizer.zero_grad(set_to_none=True)
        if job.sync is not None:
            recovery.reset_reducer(job.sync)
        redo = getattr(job.guard, "redo", None)
        if redo is not None:             # a comm hook's state (PowerSGD's) as before the failed attempt
            redo()

    def held(self, job):
        """The module whose state this rank holds (what a memory meter of the device hooks counts)."""
        return job.model.module

    # -- the step's end ------------------------------------------------------------------------
    def clip(self, job, max_norm: float) -> None:
        if hasattr(job.sync, "clip_grad_norm"):     # capacity-full: slices' norms summed over the ranks
            job.sync.clip_grad_norm(max_norm)
            return
        torch.nn.utils.clip_grad_norm_([p for p in job.model.parameters() if p.grad is not None], max_norm)

    def states(self, job):
        """What a checkpoint holds of the model and optimizer (None: resilience/store.py's default,
        runtime/sharding/state.py, for every sharding)."""
        return None

    def describe(self) -> dict:
        return {"layout": self.name}

    def close(self) -> None:
        pass


def chunked(indices, sizes) -> list:
    """`indices` cut into consecutive runs of these sizes (a step's micro-batches)."""
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [indices[a:b] for a, b in zip(bounds, bounds[1:])]


def inputs_and_targets(batch, layout: str):
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch
    raise UsageError(f"ht.loss(mb) under parallel={layout!r} takes batches of (inputs, targets), "
                     f"got a {type(batch).__name__}",
                     "return (inputs, targets) from the dataset, or compute the loss yourself and call ht.backward(loss)")
