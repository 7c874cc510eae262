"""Tensor parallelism (parallel='tp') in the user's loop: every rank holds a shard of each layer
(parallel/tensor.py: DTensor's Colwise/RowwiseParallel) and all ranks run the same micro-batches,
so the loop is data parallelism's with one replica: no gradient sync (the sharded gradients are
each rank's own, the replicated ones equal on every rank), the loss reported once.

Out of memory: DTensor's collectives run inside every layer's forward and backward, so one rank
that fails mid-layer leaves its peers in a collective that no stand-in can complete without
knowing the rest of the layer's communication. Under TP an OOM therefore ends the attempt on every
rank together (the peers' collective fails when the rank leaves), with the rank's micro-batch
recorded; torchrun's restart resumes from the last checkpoint with that micro-batch halved on every
rank of the group (runtime/resilience/oom.py, resume.py). The result is that of an OOM-free run:
resume is exact.
"""

from __future__ import annotations

from .data import DataLayout


class TensorLayout(DataLayout):
    name = "tp"

    def reports_loss(self, job) -> bool:
        return job.rank % job.plan.group == 0
