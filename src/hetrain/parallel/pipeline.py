"""Pipeline parallelism on mixed devices, on `torch.distributed.pipelining`.

    ht = hetrain.init(global_batch=32)                  # joins the job, reads --emulate
    pp = pipeline.prepare(ht, model, loss_fn=loss, micro_batches=8, example=x[:4])
    opt = torch.optim.AdamW(pp.parameters())            # this stage's parameters
    for x, y in batches:                                # every rank sees the same global batch
        loss = pp.step(x, y)                            # all micro-batches, forward and backward
        opt.step(); opt.zero_grad()
    ht.close()

What happens, and why:
  * Splitting. The model is cut between its blocks (parallel/blocks.py: an nn.Sequential, an
    nn.ModuleList, the demo GPT with embeddings on the first stage and ln_f + head on the last, or
    `PipelineParts(first=, blocks=, last=)`). Stages are hand-built `PipelineStage`s, not traced.
  * Sizing. Each block's time and activation memory are measured (`profile_blocks`), every rank's
    speed and memory are exchanged, and `planning.pipeline_split.split_pipeline` gives the slower
    devices fewer blocks, within each device's memory for the schedule's activations in flight.
  * Tied weights (the GPT's embedding = head weight). The first and last stages each hold the
    same initial weight; after the backward their gradients are summed over the two ranks, so
    both copies get the full gradient of the tied weight and stay equal under the same optimizer
    (as Megatron does). The math is that of the untied-in-memory, tied-in-value single model.
  * Uneven micro-batches. A stage allocates its receive buffers from the first micro-batch's shape,
    so all micro-batches are padded to one size µ; the loss sees only the real rows, and each
    micro-batch's mean loss is weighted by n_k/N (`runtime/reduce.loss_factor`, with the replica
    count for DP×PP) with `scale_grads=False`. torch's `scale_grads=True` divides by m, which is
    the big-batch gradient only when the micro-batches are equal. The pipeline's targets are row
    ids into the step's targets (-1 for padding), so the loss knows which rows are real.
  * Emulated speed. `forward_one_chunk` and `backward_one_chunk` (one micro-batch's forward or
    backward piece, with no communication inside) and the loss are timed and followed by a sleep
    of c·(1/s − 1): each piece lasts c/s, so the pipeline's timeline (bubbles, waits) is that of
    devices of those speeds. (Wall time of the piece, see `pipeline_stage.MeteredStage.timed`.)
  * Memory. Activations saved by each micro-batch's forward are counted until its backward frees
    them, giving the peak micro-batches and bytes in flight. Over an emulated device's cap, every
    rank raises torch.OutOfMemoryError together after the step (agreed, so no rank is left waiting).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from ..errors import UsageError
from ..hardware.units import format_bytes
from ..planning.memory import ADAMW_STATE_FACTOR
from ..planning.pipeline_split import PipelineProfile, PipelineSplit
from ..planning.plan import split_evenly
from ..runtime.ranks import agree
from ..runtime.loop import reduce
from .blocks import PipelineParts, StageModule, find_parts, param_storage_ptrs, profile_blocks
from .pipeline_sizing import (NOT_MEASURED, agreed_profile, check_pipeline_config, device_table, param_names,
                              plan_split, show, unmeasured_profile, warn_if_over)
from .pipeline_stage import Flight, MeteredStage, RowLoss

__all__ = ["prepare", "Pipeline", "PipelineParts", "find_parts", "profile_blocks", "device_table"]

_SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# -- the pipeline -----------------------------------------------------------------------------
def _sync_grads(params: Sequence[nn.Parameter], group, *, divide: int = 1, before=None) -> None:
    """Sum (then divide) over `group` what this step added to the gradients of `params` (`before`:
    their gradients before the step, None for none), in one bucket."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    added = [g if b is None else g - b for g, b in zip(grads, before or [None] * len(grads))]
    flat = _flatten_dense_tensors(added)
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat.div_(divide)
    for p, g, b in zip(params, _unflatten_dense_tensors(flat, added), before or [None] * len(grads)):
        total = g if b is None else b + g
        if p.grad is None:
            p.grad = total.clone()
        else:
            p.grad.copy_(total)


class Pipeline:
    """This rank's stage of a pipeline (one replica of it, under DP×PP). Build with `prepare()`."""

    def __init__(self, *, parts: PipelineParts, names: dict[int, str], split: PipelineSplit, stage_index: int,
                 rank_grid: Sequence[Sequence[int]], replica: int, shares: Sequence[int], global_batch: int,
                 loss_fn: Callable, device: torch.device, emulated=None, pp_group=None, dp_group=None):
        self.split = split
        self.stage_index = stage_index
        self.num_stages = split.n_stages
        self.replica, self.replicas = replica, len(rank_grid)
        self.shares = tuple(shares)
        self.global_batch = global_batch
        self.micro_batches = split.micro_batches
        self.micro_batch_size = split.micro_batch_size
        self.device = device
        self._emulated = emulated
        self._dp_group = dp_group
        start, stop = split.bounds[stage_index]
        self.module = StageModule(parts, start, stop, is_first=stage_index == 0,
                                  is_last=stage_index == self.num_stages - 1).to(device)
        self._names = names
        self._flight = Flight(param_storage_ptrs(self.module), count_bytes=emulated is not None)
        self.stage = MeteredStage(self.module, stage_index, self.num_stages, device, group=pp_group,
                                   throttle=emulated.throttle if emulated is not None else None,
                                   flight=self._flight)
        self._loss = RowLoss(loss_fn, replicas=self.replicas, timed=self.stage.timed)
        self.schedule = _SCHEDULE_CLASSES[split.schedule](self.stage, self.micro_batches, loss_fn=self._loss,
                                                          scale_grads=False)
        self._tied = _tied_groups(parts, split, rank_grid, replica, stage_index)
        self.steps = 0
        self.last_loss: float | None = None
        self.profile: PipelineProfile | None = None      # the block costs the split was sized from
        self.mesh = None                                 # the (dp, pp) mesh under DP×PP

    # -- facts --------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def bubble_fraction(self) -> float:
        """(p − 1)/(m + p − 1) for this pipeline."""
        return self.split.bubble_fraction

    def parameters(self):
        """This stage's parameters (each once): what its optimizer updates."""
        return self.module.parameters()

    def named_parameters(self):
        """This stage's parameters under the names they have in the whole model."""
        for p in self.module.parameters():
            yield self._names.get(id(p), "?"), p

    @property
    def peak_in_flight(self) -> int:
        """Most micro-batches this stage held between their forward and backward at once."""
        return self._flight.peak_count

    @property
    def peak_activation_bytes(self) -> int:
        """Peak activation bytes held (counted on emulated devices only)."""
        return self._flight.peak_bytes

    @property
    def compute_seconds(self) -> float:
        """Seconds of this stage's forward/backward/loss compute pieces, before throttling."""
        return self.stage.compute_s

    # -- the verb -----------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of one global batch (the same `inputs`, `targets` on every rank)
        through the pipeline; afterwards this stage's `.grad`s hold the big-batch gradient. Returns
        the mean loss over the global batch (the same number on every rank). A collective."""
        n = int(inputs.shape[0])
        if targets.shape[0] != n:
            raise UsageError(f"inputs have {n} rows but targets {targets.shape[0]}",
                             "pass one target row per input row")
        shares = self.shares if n == self.global_batch else _rescale(self.shares, n)
        mine = shares[self.replica]
        m, mu = self.micro_batches, self.micro_batch_size
        if n > self.global_batch or mine > m * mu or mine < m:
            raise UsageError(
                f"a step of {n} rows gives replica {self.replica} {mine} rows for {m} micro-batches of at most {mu}",
                f"pass global batches of {self.global_batch} rows (at least {m * self.replicas}); "
                "drop the last partial batch")
        start = sum(shares[:self.replica])
        rows, pick = _padded_rows(mine, m, mu)
        self._loss.begin(targets[start:start + mine].to(self.device) if self.is_last else None, n)
        args = (inputs[start:start + mine][pick].to(self.device),) if self.is_first else ()
        target = rows.to(self.device) if self.is_last else None
        losses: list[torch.Tensor] = []      # the weighted loss of each micro-batch (last stage)
        # Gradients accumulated over earlier steps are already whole on every holder of a tied
        # weight: sum only what this step adds. (Across replicas they are equal, so averaging
        # the total is the same as averaging the increment.)
        tied_before = [[None if p.grad is None else p.grad.clone() for p in params] for params, _ in self._tied]
        self.schedule.step(*args, target=target, losses=losses if self.is_last else None, return_outputs=False)
        for (params, group), before in zip(self._tied, tied_before):
            _sync_grads(params, group, before=before)
        if self.replicas > 1:
            _sync_grads(list(self.module.parameters()), self._dp_group, divide=self.replicas)
        self.steps += 1
        # Σ_k (D·n_k/N)·L_k / D: this replica's part of the global mean loss
        part = float(sum(float(l.detach()) for l in losses)) / self.replicas
        return self._agree_after_step(part)

    def _agree_after_step(self, loss_part: float) -> float:
        cap = self._emulated.meter.cap if self._emulated is not None else None
        fixed = self._emulated.meter.fixed if self._emulated is not None else 0
        peak = self._flight.peak_bytes + fixed
        table = agree.exchange(
            {"loss": loss_part, "peak_bytes": float(peak),
             "cap": float(cap or 0), "stage": float(self.stage_index), "replica": float(self.replica)},
            rank=dist.get_rank(), world_size=dist.get_world_size(), device=self.device)
        over = [r for r in range(dist.get_world_size())
                if table.row(r)["cap"] and table.row(r)["peak_bytes"] > table.row(r)["cap"]]
        if over:
            rows = ", ".join(f"rank {r} (stage {int(table.row(r)['stage'])}): "
                             f"{format_bytes(table.row(r)['peak_bytes'])} of {format_bytes(table.row(r)['cap'])}"
                             for r in over)
            raise torch.OutOfMemoryError(
                f"pipeline out of memory (emulated): {rows}; try schedule='1f1b', more and smaller "
                "micro-batches, activation checkpointing, or another split")
        self.last_loss = table.sum("loss")
        return self.last_loss

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the whole model's gradient norm (all stages; a tied weight counted once). A collective."""
        own = [p for p in self.module.parameters() if p.grad is not None]
        tied_elsewhere = {id(p) for params, _ in self._tied for p in params} if not self.is_first else set()
        sq = sum(float(p.grad.detach().double().pow(2).sum()) for p in own if id(p) not in tied_elsewhere)
        table = agree.exchange({"sq": sq if self.replica == 0 else 0.0}, rank=dist.get_rank(),
                               world_size=dist.get_world_size(), device=self.device)
        norm = math.sqrt(table.sum("sq"))
        if norm > max_norm:
            reduce.scale_gradients(own, max_norm / (norm + 1e-6))
        return norm

    def describe(self) -> list[str]:
        return [*self.split.describe(), f"bubble fraction {self.bubble_fraction:.0%} = (p−1)/(m+p−1), "
                f"p={self.num_stages}, m={self.micro_batches}"]

    def close(self) -> None:
        """Drop the stage and schedule (before ht.close())."""
        self.schedule = self.stage = None
        self._tied = []


def _rescale(shares: Sequence[int], n: int) -> tuple[int, ...]:
    from ..planning.shares import proportional_shares

    return proportional_shares(n, list(shares))


def _padded_rows(n: int, m: int, mu: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids of m micro-batches of µ rows holding n real rows (−1: padding), and the input row
    each position reads (padding repeats its micro-batch's first row)."""
    sizes = split_evenly(n, m)
    rows, pick, start = [], [], 0
    for k in sizes:
        rows += list(range(start, start + k)) + [-1] * (mu - k)
        pick += list(range(start, start + k)) + [start] * (mu - k)
        start += k
    return torch.tensor(rows), torch.tensor(pick)


def _tied_groups(parts: PipelineParts, split: PipelineSplit, rank_grid, replica: int, stage_index: int):
    """Process groups for parameters held by more than one stage, and this stage's share of them.
    Every rank creates every group, in the same order (torch requires it)."""
    per_stage = []
    for s, (a, b) in enumerate(split.bounds):
        module = StageModule(parts, a, b, is_first=s == 0, is_last=s == split.n_stages - 1)
        per_stage.append({id(p): p for p in module.parameters()})
    holders: dict[int, list[int]] = {}
    for s, params in enumerate(per_stage):
        for pid in params:
            holders.setdefault(pid, []).append(s)
    by_stages: dict[tuple[int, ...], list[int]] = {}
    for pid, stages in holders.items():
        if len(stages) > 1:
            by_stages.setdefault(tuple(stages), []).append(pid)
    out = []
    for stages, pids in sorted(by_stages.items()):
        for r, ranks in enumerate(rank_grid):
            group = dist.new_group([ranks[s] for s in stages])
            if r == replica and stage_index in stages:
                mine = per_stage[stage_index]
                out.append(([mine[pid] for pid in pids], group))
    return out


# -- prepare ---------------------------------------------------------------------------------
def prepare(ht, model: nn.Module | PipelineParts, *, loss_fn: Callable, micro_batches: int | None = None,
            schedule: str = "1f1b", example: torch.Tensor | None = None,
            split: Sequence[int] | str | None = None, state_factor: float = ADAMW_STATE_FACTOR) -> Pipeline:
    """Cut `model` into one stage per rank (rank r runs stage r), sized by each device's speed and
    memory, and return this rank's Pipeline. `loss_fn(output, target)` is a mean over samples.
    `split`: None (measure the blocks on `example` and size by speed), 'uniform', or blocks per
    stage. Every rank calls it with the same arguments (a collective)."""
    parts = find_parts(model)
    p = ht.world_size
    m = check_pipeline_config(ht, schedule, micro_batches, p)
    devices = device_table(ht)
    if split is None or example is not None:
        profile, devices = agreed_profile(ht, parts, example, devices)
    else:
        profile = unmeasured_profile(parts)
    plan = plan_split(profile, devices, split, micro_batches=m,
                      micro_batch_size=math.ceil(ht.config.global_batch / m), schedule=schedule,
                      state_factor=state_factor, memory_margin=ht.config.memory_margin)
    warn_if_over(ht, [plan])
    pp = Pipeline(parts=parts, names=param_names(model), split=plan, stage_index=ht.rank,
                  rank_grid=[list(range(p))], replica=0, shares=(ht.config.global_batch,),
                  global_batch=ht.config.global_batch, loss_fn=loss_fn, device=ht.device, emulated=ht.emulated)
    pp.profile = profile
    if ht.emulated is not None:
        ht.emulated.meter.set_fixed(pp.module, None)
    show(ht, f"pipeline: {p} stages, {schedule}, {m} micro-batches of {plan.micro_batch_size}", [plan],
         plan.reasons, measured=profile.source != NOT_MEASURED)
    return pp


