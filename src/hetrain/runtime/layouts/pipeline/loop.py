"""Pipeline layouts (parallel='pp', 'dp-pp') in the user's own loop.

    for step in batches:
        for mb in step:                  # this replica's micro-batches, the same on each of its stages
            with mb:
                ht.backward(ht.loss(mb))  # recorded (tokens= too): nothing runs yet
        ht.step()

The schedule (GPipe or 1F1B, torch.distributed.pipelining) needs every micro-batch at once, so
`ht.loss(mb)` returns a PendingLoss and `ht.backward` records it with the micro-batch's units
(samples or tokens); once the last micro-batch is recorded, the rank's pass runs the schedule
(layouts/pipeline/schedule.py: Pipeline.run) and the step's agreement, the optimizer step, checkpoints and
OOM recovery are the same code as under data parallelism (runtime/loop/stepping.py):
  * the loss and units of a replica are reported once, by its last stage;
  * an OOM on any stage is completed with stand-ins (layouts/pipeline/stage.py), reported in the
    step's table, and every rank redoes the step; the failing replica's micro-batches shrink
    together (one µ for all its stages), the others keep theirs;
  * rebalancing is off: shares move between replicas only by re-planning (a restart).
"""

from __future__ import annotations

import math

import torch

from ....errors import UsageError
from ....planning.plan import split_evenly
from ...resilience import oom as recovery
from ...loop.steps import MicroBatch
from ..data import DataLayout, chunked, inputs_and_targets


class PendingLoss:
    """A micro-batch's loss under a pipeline: computed by the schedule once every micro-batch is
    recorded. Its value is the step's (`step.loss` after ht.step())."""

    def __init__(self, mb: MicroBatch):
        self.mb = mb

    def __float__(self) -> float:
        raise UsageError("a pipeline micro-batch's loss has no value before the schedule ran",
                         "read step.loss after ht.step() (the mean loss over the whole global batch)")

    def item(self) -> float:
        return float(self)


class PipelineLayout(DataLayout):
    """parallel='pp' or 'dp-pp': this rank runs one stage of one pipeline replica."""

    deferred = True

    def __init__(self, name: str, loss_fn, pipe):
        super().__init__(loss_fn)
        self.name, self.pipe = name, pipe
        self._recorded: list[tuple[MicroBatch, float]] = []

    def loss(self, job, mb: MicroBatch) -> PendingLoss:
        inputs_and_targets(mb.batch, self.name)
        return PendingLoss(mb)

    def record(self, job, mb: MicroBatch, loss, units) -> None:
        if not isinstance(loss, PendingLoss) or loss.mb is not mb:
            raise UsageError(f"under parallel={self.name!r} ht.backward() takes the loss ht.loss(mb) returned "
                             "for this micro-batch (the model is split over the ranks: no rank computes it alone)",
                             "write `ht.backward(ht.loss(mb))` inside `with mb:`, with loss_fn= given to prepare()")
        self._recorded.append((mb, float(units)))

    def reports_loss(self, job) -> bool:
        return self.pipe.is_last

    def rank_pass(self, loop, state):
        job, step = loop.job, state.step
        share = job.plan.devices[job.rank].share
        sizes = split_evenly(share, math.ceil(share / state.micro))
        self._recorded = []
        chunks = chunked(step.indices, sizes)
        for k, (size, chunk, batch) in enumerate(zip(sizes, chunks, job.read(chunks))):
            mb = MicroBatch(batch=batch, size=size, index=k, count=len(sizes), indices=chunk,
                            catch_oom=False)
            state.mb = mb
            yield mb
            if not mb.backward_done:
                raise UsageError(f"micro-batch {k} of step {step.index} ended without ht.backward(ht.loss(mb))",
                                 "call ht.backward(ht.loss(mb)) once inside every micro-batch")
        state.mb = None
        inputs = [mb.batch[0] if self.pipe.is_first else None for mb, _ in self._recorded]
        targets = [mb.batch[1] for mb, _ in self._recorded]
        units = [u for _, u in self._recorded]
        job.hooks.attempt_start()
        before = self.pipe.busy()
        loss_sum, failed = self.pipe.run(inputs, targets, units, global_batch=job.config.global_batch,
                                         step_index=step.index)
        after = self.pipe.busy()       # the stage's pieces are the step's compute (the summary's busy)
        job.hooks.compute_s, job.hooks.busy_s = after[0] - before[0], after[1] - before[1]
        mine = self.pipe.is_last
        state.count = torch.tensor(float(sum(units)) if mine else 0.0, dtype=torch.float64)
        state.loss_sum = torch.tensor(loss_sum if mine else 0.0, dtype=torch.float64)
        if failed is None:
            return "ok"
        job.run.ooms += 1
        smaller = recovery.smaller_micro_batch(state.micro)
        job.log.warn(f"{job.device_label}: out of memory at step {step.index} on stage {self.pipe.stage_index}, "
                     + (f"redoing with micro-batch {state.micro} -> {smaller} on its pipeline" if smaller
                        else "cannot shrink") + f" ({failed})")
        if smaller is None:
            return "fatal"
        state.micro = smaller
        return "desync"

    def redo(self, job) -> None:
        job.optimizer.zero_grad(set_to_none=True)

    def held(self, job):
        return self.pipe.module

    def clip(self, job, max_norm: float) -> None:
        self.pipe.clip_grad_norm_(max_norm)

    def states(self, job):
        from .stage_state import StageState

        return StageState(self.pipe, job.optimizer, job.model.module)

    def describe(self) -> dict:
        return {"layout": self.name, "stage": self.pipe.stage_index, "replica": self.pipe.replica}

    def close(self) -> None:
        self.pipe.close()
