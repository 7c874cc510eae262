"""Tensor parallelism (parallel='tp') in the user's loop: every rank holds a shard of each layer
(layouts/tensor/shard.py) and all ranks run the same micro-batches, so the loop is data parallelism's
with one replica: no gradient sync (the sharded gradients are each rank's own, the replicated ones
equal on every rank), the loss reported once.

The split: `parallel=hetrain.TensorParallel(split='even')` (default; also parallel='tp') cuts every
layer evenly with DTensor's Colwise/RowwiseParallel; `TensorParallel(split='speed')` in proportion to each device's speed in the plan
every rank agreed on (its measured samples/s relative to the fastest: the same numbers as the
data-parallel shares), as whole key/value groups of heads and whole MLP columns
(layouts/tensor/uneven.py). Under the split by speed the sharded gradients are plain tensors,
so gradient clipping sums their squares over the ranks itself, and checkpoints hold every
sharded entry whole under the whole model's names (layouts/tensor/state.py).

Out of memory: the collectives run inside every layer's forward and backward, so one rank
that fails mid-layer leaves its peers in a collective that no stand-in can complete without
knowing the rest of the layer's communication. Under TP an OOM therefore ends the attempt on every
rank together (the peers' collective fails when the rank leaves), with the rank's micro-batch
recorded; torchrun's restart resumes from the last checkpoint with that micro-batch halved on every
rank of the group (runtime/resilience/oom.py, resume.py). The result is that of an OOM-free run:
resume is exact.
"""

from __future__ import annotations

from ....errors import UsageError
from ..data import DataLayout


class TensorLayout(DataLayout):
    name = "tp"

    def reports_loss(self, job) -> bool:
        return job.rank % job.plan.group == 0

    def clip(self, job, max_norm: float) -> None:
        from .uneven import clip_grad_norm, sharded_parameters

        if sharded_parameters(job.model.module):    # a split by speed: plain-tensor shards
            clip_grad_norm(job.model.module, max_norm)
        else:
            super().clip(job, max_norm)

    def states(self, job):
        from .state import ShardState
        from .uneven import sharded_parameters

        if sharded_parameters(job.model.module):
            return ShardState(job.model.module, job.optimizer)
        return None                                  # DTensor shards: DCP's own resharding


def wrap(job, model, optimizer, *, split: str = "even"):
    """The model's layers sharded over every rank (layouts/tensor/shard.py), evenly or by the plan's
    speeds (TensorParallel(split=...)), and the optimizer rebuilt over the sharded parameters
    (a collective for the even split: DTensor's mesh)."""
    from .shard import compute_share, rebuild, shard
    from ...sharding.wrap import Wrapped

    computes = {e["compute"] for e in job.precision.all_choices}
    if len(computes) > 1:   # every rank decides from the same gathered choices: all raise together
        raise UsageError(
            "tensor parallelism runs the shards of each layer in lockstep, in one dtype (their collectives "
            "exchange it), but these ranks would compute " + ", ".join(
                f"rank {e['rank']} {e['compute']}" for e in job.precision.all_choices),
            "pass one precision for the whole job (precision='fp16' or 'fp32'), or put equal devices in the "
            "tensor-parallel group and mixed ones in pipeline stages (parallel='pp')")
    by_speed = split == "speed"
    speeds = [d.speed for d in job.plan.devices] if by_speed else None    # the agreed plan's: every rank's
    names = {p: n for n, p in model.named_parameters()}
    done = shard(model, speeds=speeds)
    new = dict(model.named_parameters())
    opt = rebuild(optimizer, {p: [new[m] for m in done.renamed.get(n, (n,))] for p, n in names.items()})
    share = compute_share(model)
    job.hooks.model_sharded(model, opt, share)
    how = (f"in proportion to speed ({'/'.join(f'{s:.2f}' for s in speeds)}): " if by_speed
           else "evenly (DTensor): ")
    lines = [f"parallel=tp: every layer split over {job.world_size} devices {how}{done.describe()}; this rank "
             f"computes {share:.1%} of the model's Linear weights; in-loop OOM recovery is off "
             "(runtime/layouts/tensor/loop.py says why): an OOM ends the attempt and --max-restarts resumes smaller"]
    if done.renamed:
        lines.append(f"parallel=tp: {len(done.renamed)} fused parameters became q, k, v Linears "
                     "(layouts/tensor/hf.py): checkpoints hold them by their new names")
    return Wrapped("tp", model, opt, None, lines=lines)
