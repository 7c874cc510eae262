"""Pipeline parallelism on mixed devices, on `torch.distributed.pipelining`: one stage of one
pipeline replica, run by the user's loop through hetrain's verbs (runtime/layouts/pipeline/loop.py).

    model, opt, batches = ht.prepare(model, opt, dataset, parallel="pp", loss_fn=loss_fn)
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))      # recorded: the schedule runs once all are in
        ht.step()

What happens, and why:
  * Splitting. The model is cut between its blocks (layouts/pipeline/blocks.py: an nn.Sequential, an
    nn.ModuleList, the demo GPT with embeddings on the first stage and ln_f + head on the last, or
    `PipelineParts(first=, blocks=, last=)`). Stages are hand-built `PipelineStage`s, not traced.
  * Sizing (layouts/pipeline/sizing.py, runtime/layouts/pipeline/split.py): slower devices get fewer
    blocks, within each device's memory for the schedule's activations in flight.
  * Tied weights (the GPT's embedding = head weight). The first and last stages each hold the
    same initial weight; after the backward their gradients are summed over the two ranks, so
    both copies get the full gradient of the tied weight and stay equal under the same optimizer
    (as Megatron does).
  * Uneven micro-batches. A stage allocates its receive buffers from the first micro-batch's shape,
    so all micro-batches are padded to one size µ; the loss sees only the real rows, and each
    micro-batch's mean loss is weighted by D·n_k/N (`runtime/loop/reduce.loss_factor`; n_k samples
    or tokens, D replicas) with `scale_grads=False`. torch's `scale_grads=True` divides by m, which
    is the big-batch gradient only when the micro-batches are equal.
  * Precision. Each stage computes under its own device's autocast; activations cross stages in
    fp32 (a bf16 stage may feed an fp16 one), and the loss is multiplied by the one job-wide loss
    scale (runtime/devices/precision_policy.py), whose overflow check every rank agrees.
  * Out of memory (pipeline_stage.py). A stage that runs out of memory in a micro-batch's forward
    or backward keeps the schedule's sends and receives going with stand-in zeros of the agreed
    shapes, so no peer waits; the step's agreement then has every rank redo it with smaller
    micro-batches. A device that counts its own bytes raises the same error past its memory.
  * Device time. `forward_one_chunk` and `backward_one_chunk` (one micro-batch's piece, with no
    communication inside) are timed on the device's clock and handed to the device after they ran
    (stage_hooks.StageHooks: its hooks' answer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from ...devices import clock as clocks
from .split import PipelineSplit
from ...ranks import agree
from ...loop import reduce
from .blocks import PipelineParts, StageModule, find_parts, param_storage_ptrs, profile_blocks
from .stage import Flight, MeteredStage, RowLoss
from .stage_hooks import StageHooks

__all__ = ["Pipeline", "PipelineParts", "find_parts", "profile_blocks"]

_SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _sync_grads(params: Sequence[nn.Parameter], group, *, divide: int = 1, before=None) -> None:
    """Sum (then divide) over `group` what this step added to the gradients of `params` (`before`:
    their gradients before the step, None for none), in one bucket."""
    if not params:
        return
    clocks.sync_point()          # the gradients leave once the device computed them (the host waits for it)
    device = params[0].device          # the job's: the stage's parameters live there
    grads = [p.grad if p.grad is not None else torch.zeros_like(p, device=device) for p in params]
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
    """This rank's stage of a pipeline (one replica of it, under DP×PP)."""

    def __init__(self, *, parts: PipelineParts, names: dict[int, str], split: PipelineSplit, stage_index: int,
                 rank_grid: Sequence[Sequence[int]], replica: int, loss_fn: Callable, device: torch.device,
                 stage_hooks: StageHooks | None = None, precision=None, faults=None, pp_group=None, dp_group=None,
                 timeout_s: float = 600.0):
        self.split = split
        self.stage_index = stage_index
        self.num_stages = split.n_stages
        self.replica, self.replicas = replica, len(rank_grid)
        self.schedule_name = split.schedule
        self.device = device
        self._on = stage_hooks if stage_hooks is not None else StageHooks()
        self._precision, self._faults = precision, faults
        self._pp_group, self._dp_group = pp_group, dp_group
        self.parts, self.rank_grid = parts, rank_grid
        start, stop = split.bounds[stage_index]
        self.module = StageModule(parts, start, stop, is_first=stage_index == 0,
                                  is_last=stage_index == self.num_stages - 1).to(device)
        self._names = names
        self._flight = Flight(param_storage_ptrs(self.module), count_bytes=self._on.counts_bytes)
        self._loss_fn = loss_fn
        self._built: tuple[int, int] | None = None      # (micro-batches, µ) the stage was built for
        self.stage = self.schedule = self._loss = None
        self._timeout_s = timeout_s
        self._tied_made: dict = {}                     # the tied weights' groups made so far, by holders
        self._tied = _tied_groups(parts, split, rank_grid, replica, stage_index, timeout_s, self._tied_made)
        self.group_names: list[list[str]] = []         # the optimizer's param groups by whole-model name
        self.compute_s = self.busy_s = 0.0             # of the stages built before the current one
        self.profile = None                              # the block costs the split was sized from

    # -- facts --------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

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
        """Peak activation bytes held (counted where the device counts its own bytes only)."""
        return self._flight.peak_bytes

    # -- the step -------------------------------------------------------------------------------
    def _build(self, m: int, mu: int) -> None:
        """The stage and schedule for m micro-batches of µ rows: built again when an OOM shrank µ
        (the receive buffers have µ rows). Every rank of the pipeline rebuilds at the same step:
        the plan they agreed changed for all of them."""
        if self._built == (m, mu):
            return
        if self.stage is not None:
            self.compute_s += self.stage.compute_s
            self.busy_s += self.stage.busy_s
        self.stage = MeteredStage(self.module, self.stage_index, self.num_stages, self.device, group=self._pp_group,
                                  stage_hooks=self._on, flight=self._flight, precision=self._precision,
                                  faults=self._faults, micro_s=self.given_micro_s(mu))
        self._loss = RowLoss(self._loss_fn, replicas=self.replicas, stage=self.stage, precision=self._precision)
        self.schedule = _SCHEDULE_CLASSES[self.schedule_name](self.stage, m, loss_fn=self._loss, scale_grads=False)
        self._built = (m, mu)

    def given_micro_s(self, mu: int) -> float | None:
        """A micro-batch of µ rows through this stage at speed 1 where the device gives its length
        (StageHooks.micro_batch_s, from this stage's parts in self.profile, the blocks as the job
        runs them). None where the device's time is measured, or with no profile (the pieces then
        keep their measured time)."""
        if self.profile is None:
            return None
        start, stop = self.split.bounds[self.stage_index]
        per_row = self.profile.stage_seconds(start, stop, first=self.is_first, last=self.is_last)
        whole = self.profile.stage_seconds(0, len(self.profile.blocks), first=True, last=True)
        return self._on.micro_batch_s(mu, per_row, whole)

    def run(self, inputs: Sequence, targets: Sequence, units: Sequence[float], *, global_batch: int,
            step_index: int) -> tuple[float, str | None]:
        """Forward and backward of this replica's micro-batches (inputs[k], targets[k], weighted by
        units[k] of the step's `global_batch`) through the pipeline; afterwards this stage's
        `.grad`s hold its part of the big-batch gradient (tied weights summed, replicas averaged).
        Returns (Σ_k units_k·L_k on the last stage, else 0; why this rank ran out of memory, or
        None). A collective of the whole job: every rank runs it once per attempt of a step."""
        sizes = [int(x.shape[0]) if x is not None else int(t.shape[0]) for x, t in zip(inputs, targets)]
        m, mu = len(sizes), max(sizes)
        self._build(m, mu)
        self.stage.begin_step(step_index, m)
        rows, pick = _padded_rows(sizes, mu)
        if self.is_last:
            self._loss.begin(torch.cat([t.to(self.device) for t in targets]), sizes, units, global_batch)
        args = (torch.cat([x.to(self.device) for x in inputs])[pick],) if self.is_first else ()
        losses: list[torch.Tensor] = []
        # Gradients accumulated over earlier steps are already whole on every holder of a tied
        # weight: sum only what this step adds.
        tied_before = [[None if p.grad is None else p.grad.clone() for p in params] for params, _ in self._tied]
        self.schedule.step(*args, target=rows.to(self.device) if self.is_last else None,
                           losses=losses if self.is_last else None, return_outputs=False)
        for (params, group), before in zip(self._tied, tied_before):
            _sync_grads(params, group, before=before)
        if self.replicas > 1:
            _sync_grads(list(self.module.parameters()), self._dp_group, divide=self.replicas)
        return (self._loss.weighted_sum if self.is_last else 0.0), self.stage.failed

    def busy(self) -> tuple[float, float]:
        """(compute, busy) seconds of this stage's pieces so far, over every stage built."""
        stage = self.stage
        return (self.compute_s + (stage.compute_s if stage else 0.0), self.busy_s + (stage.busy_s if stage else 0.0))

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

    def resplit(self, split: PipelineSplit, optimizer: torch.optim.Optimizer, *, version: int) -> str | None:
        """Run `split` (the same blocks, cut elsewhere) from the next step on: a collective of the
        pipeline, at a step boundary (runtime/layouts/pipeline/resplit.py decides it). The blocks this stage
        gains arrive with their parameters, buffers and optimizer state (layouts/pipeline/move.py),
        the stage and schedule are built afresh at the next step (its receive buffers and shapes
        are the new boundary's), and the tied weights' groups follow their holders. Returns None, or
        why nothing moved (the same on every rank)."""
        from .move import move_blocks

        old = self.split.bounds[self.stage_index]
        why = move_blocks(parts=self.parts, old_bounds=self.split.bounds, new_bounds=split.bounds,
                          stage=self.stage_index, ranks=self.rank_grid[self.replica], optimizer=optimizer,
                          device=self.device, names=self._names, group_names=self.group_names, version=version,
                          sizes=split.sizes, group=self._pp_group)
        if why is not None:
            return why
        start, stop = split.bounds[self.stage_index]
        self.module.reslice(self.parts, start, stop)
        self.module.to(self.device)
        if self.device.type != "cpu":    # what this stage no longer trains leaves its memory
            held = {id(p) for p in self.module.parameters()}
            for block in self.parts.blocks[old[0]:old[1]]:
                if not any(id(p) in held for p in block.parameters()):
                    block.to("cpu")
        self.split = split
        self._flight.skip = param_storage_ptrs(self.module)
        self._tied = _tied_groups(self.parts, split, self.rank_grid, self.replica, self.stage_index,
                                  self._timeout_s, self._tied_made)
        self._built = None
        return None

    def describe(self) -> list[str]:
        return [*self.split.describe(), f"bubble fraction {self.split.bubble_fraction:.0%} = (p−1)/(m+p−1), "
                f"p={self.num_stages}, m={self.split.micro_batches}"]

    def close(self) -> None:
        """Drop the stage and schedule (before the process group goes)."""
        self.schedule = self.stage = None
        self._tied = []


def _padded_rows(sizes: Sequence[int], mu: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ids of len(sizes) micro-batches of µ rows holding sizes[k] real rows each (−1: padding),
    and the input row each position reads (padding repeats its micro-batch's first row)."""
    rows, pick, start = [], [], 0
    for k in sizes:
        rows += list(range(start, start + k)) + [-1] * (mu - k)
        pick += list(range(start, start + k)) + [start] * (mu - k)
        start += k
    return torch.tensor(rows), torch.tensor(pick)


def _tied_groups(parts: PipelineParts, split: PipelineSplit, rank_grid, replica: int, stage_index: int,
                 timeout_s: float, made: dict):
    """Process groups for parameters held by more than one stage, and this stage's share of them.
    Every rank creates every group, in the same order (torch requires it), with the job's timeout;
    `made` keeps them by (holders, replica), so a re-split whose tied weights stay where they were
    (the first and last parts never move) creates none."""
    from datetime import timedelta

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
            if (stages, r) not in made:
                made[stages, r] = dist.new_group([ranks[s] for s in stages], timeout=timedelta(seconds=timeout_s))
            group = made[stages, r]
            if r == replica and stage_index in stages:
                mine = per_stage[stage_index]
                out.append(([mine[pid] for pid in pids], group))
    return out
