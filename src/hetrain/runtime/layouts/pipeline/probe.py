"""How much longer a block takes as a pipeline stage runs it than alone, measured where a pipeline is
sized (layouts/pipeline/setup.measure_blocks: in `hetrain plan`, and in a job unless the cache has
it).

The pipeline model (runtime/layouts/pipeline/split.py) costs a stage's micro-batch from its blocks, timed
one by one (layouts/pipeline/blocks.profile_blocks). A stage runs more than its blocks: the pipelining
schedule's forward_one_chunk and backward_one_chunk (argument flattening, detaching the inputs,
stage_backward's autograd call), hetrain's metering around each piece (its autocast, and where the
device counts its own bytes a hook per saved tensor) and whatever the device does after every
piece (stage_hooks.StageHooks.piece_done), which may leave the next piece on cold caches. Most
of that is per op, so it grows with the blocks a stage holds and not with the micro-batch's rows.
Measured on the demo GPT (4 blocks of d=128, micro-batches of 4, an AMX Xeon, fp32, devices of
speeds 0.5 and 0.335): the whole model as a one-stage pipeline took 6.62 ms a micro-batch beyond
its blocks' ~14.9, its first block alone 1.76 ms beyond its 3.46; the ranking, which had stretched
the blocks by the whole model's fixed cost per micro-batch, predicted the 2-stage pipeline 44% too
fast (bf16). So each rank times the first block as a one-stage pipeline (a copy: the job's model
is left as it was; one block, as the model may not fit one device), fed what `first` makes of the
example, at 1 row and at the example's µ rows, and fits

    t(µ) = block_s + stage_factor · µ · s         (s: the block's profiled seconds a row)

(the same host and model: x1.05 + 1.02 ms a block in fp32, x0.92 + 1.89 ms in bf16, whose autocast
adds work per op). It runs on a process group of its own rank, under its device's autocast, on
the device as the probe uses it (StageHooks.for_probe: books of its own, the job's keep theirs).
A piece's time is its wall time as measured, as the runtime meters it
(pipeline_stage.MeteredStage.timed); on CUDA, whose pieces return before their kernels finish, the
step's synchronised wall time. The ranks measure one at a time, as the blocks are measured (a
whole-model version of this probe, four ranks on 2 cores, fp32, read 10.7 ms a micro-batch all at
once and 5.4-7.5 ms in turn: the ranks slowing each other, which the stage hooks measure apart,
below), and the ranks' medians are kept: the same figures on every rank. The sizes (and the first
and last parts, below) are stepped in turn within a rank's turn, so a host whose speed drifts in
phases of seconds slows them alike.

The first and last parts are timed the same way at µ rows (the last with a stand-in loss metered
as a piece of its own, as the runtime's last stage meters the user's): what they take beyond their
rows at the blocks' factor is their stage's fixed cost a micro-batch (first_s, last_s).

Where the stages share a host, the device measures what that adds to a step (StageHooks.
probe_host, given a block's piece to time on a plain device and the schedule's own CPU a piece,
outside the metered pieces): the figures the profile keeps (PipelineProfile.host).
"""

from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist

from ...devices import clock as clocks
from ...ranks import agree
from .stage_hooks import StageHooks

# Timed steps, after one warm-up. 4 were too few on a shared host: four `hetrain plan` runs of the
# dilated DP×PP 2×2 cluster (2-core AMD EPYC VM, wall clock) predicted its row 101-125 samples/s
# (spread 21%) with 4 steps here and 5 repeats in profile_blocks, 108-115 (6%) with 8 and 15, for
# 4 s more of probing.
STEPS = 8


def time_stage_cost(parts, profile, example: torch.Tensor, *, device: torch.device, micro_batches: int = 8,
                    precision=None, stage_hooks: StageHooks | None = None, steps: int = STEPS) -> dict:
    """How a stage runs a block, against the block's profiled time s (a collective: every rank
    calls it with the same parts): a micro-batch of µ rows takes o + f·µ·s, o seconds per block
    whatever µ (the per-op work around it) and f·s per row. Timed at µ = 1 and µ = the rows of
    `example` (one micro-batch of inputs); `profile`: the parts' costs (profile_blocks);
    `stage_hooks`: the job's device as its stages ask it (None: one that times its own work).
    Returns {"factor", "block_s", "ranks" (each rank's (factor, block_s)), "micro_batch",
    "micro_batches", "steps"}, with "first_s"/"last_s" where the model has those parts and "host"
    where the stages share one (module docstring)."""
    on = stage_hooks if stage_hooks is not None else StageHooks()
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = solo_group()
    x = _block_input(parts, example, device, precision)
    big = int(x.shape[0])
    sizes = (1, big) if big > 1 else (1,)
    times, ends, between = {}, {}, 0.0
    edge = {"first": (parts.first, example.to(device)), "last": (parts.last, x)}
    for turn in range(world):     # one rank at a time (see the module's note), the others wait
        if turn == rank:
            # Interleaved, step by step: a host whose speed drifts in phases of seconds slows every
            # size alike, so the line through them keeps its slope.
            runs = {("block", mu): _one_stage(parts, x[:mu], device=device, micro_batches=micro_batches, group=solo,
                                              precision=precision, on=on) for mu in sizes}
            runs.update({(name, big): _one_stage(parts, inp[:big], device=device, micro_batches=micro_batches,
                                                 group=solo, precision=precision, on=on, part=part)
                         for name, (part, inp) in edge.items() if part is not None})
            got = _interleaved(runs, steps)
            times = {mu: got[("block", mu)][0] for mu in sizes}
            between = got[("block", big)][1]
            ends = {name: t for (name, _), (t, _) in got.items() if name != "block"}
        dist.barrier()
    s = profile.blocks[0].seconds
    if len(sizes) == 2 and s > 0:     # the line through both sizes: slope f·s, intercept o
        factor = max((times[big] - times[1]) / ((big - 1) * s), 1e-3)
        block_s = max(times[1] - factor * s, 0.0)
    else:
        factor, block_s = (times[1] / s if s > 0 else 1.0), 0.0
    # The first and last parts as a stage runs them: what they take beyond their rows at the blocks'
    # factor is theirs a micro-batch (the last's includes the loss, metered as a piece of its own).
    part_s = {f"{name}_s": max(0.0, t - big * getattr(profile, name).seconds * factor) for name, t in ends.items()}
    table = agree.exchange({"factor": factor, "block_s": block_s, "between_s": between, **part_s},
                           rank=rank, world_size=world, device=device)
    ranks = list(zip(table.column("factor"), table.column("block_s")))
    out = {"factor": statistics.median(f for f, _ in ranks), "block_s": statistics.median(b for _, b in ranks),
           "ranks": ranks, "micro_batch": big, "micro_batches": micro_batches, "steps": steps,
           **{k: statistics.median(table.column(k)) for k in part_s}}
    plain = StageHooks()           # a block's piece as a device that adds nothing to it runs it

    def time_piece() -> float:
        return _time_block(parts, x[:max(1, big)], device=device, micro_batches=micro_batches, group=solo,
                           precision=precision, on=plain, steps=steps)
    host = on.probe_host(time_piece, x, device=device,                                             # (collective)
                         overhead_s=statistics.median(table.column("between_s")))
    if host is not None:
        out["host"] = host
    return out


_SOLO: dict = {}      # the default group -> this rank's group of itself, made once for it


def solo_group():
    """This rank's process group of its own rank alone, for one-stage pipelines (a collective the
    first time a default group asks: every rank creates every rank's group, in order). Made once
    per default group and kept: each new group is a communicator (on NCCL, GPU memory and setup
    time) that nothing else would destroy before the job's end."""
    world = dist.group.WORLD
    if _SOLO.get("world") is not world:      # a new default group: the old one's groups went with it
        _SOLO.clear()
        _SOLO.update(world=world, solo=[dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()])
    return _SOLO["solo"]


def _time_block(parts, x: torch.Tensor, *, device, micro_batches: int, group, precision, on: StageHooks,
                steps: int, part=None) -> float:
    """Median seconds per micro-batch of x's rows of the first block (or `part`) run as a
    one-stage pipeline."""
    run = _one_stage(parts, x, device=device, micro_batches=micro_batches, group=group, precision=precision,
                     on=on, part=part)
    return _interleaved({0: run}, steps)[0][0]


def _interleaved(runs: dict, steps: int) -> dict:
    """{key: (median seconds a micro-batch, median schedule CPU a piece)} of one-stage runners
    (`_one_stage`), each warmed up once and then stepped in turn `steps` times."""
    got: dict = {key: ([], []) for key in runs}
    for i in range(steps + 1):
        for key, run in runs.items():
            spent, between = run(i)
            if i:                     # the first builds the stage's buffers
                got[key][0].append(spent)
                got[key][1].append(between)
    return {key: (statistics.median(a), statistics.median(b)) for key, (a, b) in got.items()}


def _one_stage(parts, x: torch.Tensor, *, device, micro_batches: int, group, precision, on: StageHooks,
               part=None):
    """The first block (or `part`) as a one-stage pipeline of micro-batches of x's rows, on the
    device as the probe uses it (`on.for_probe()`): a function of the step's index that runs one
    step and returns (seconds a micro-batch, the schedule's own CPU seconds a piece outside the
    metered pieces: its bookkeeping, the loss call, which the device's piece_done never sees)."""
    from torch.distributed.pipelining import ScheduleGPipe

    from .blocks import PipelineParts, StageModule, param_storage_ptrs
    from .stage import Flight, MeteredStage

    # One block, as a stage of its own: the model need not fit one device (why it is pipelined).
    module = copy.deepcopy(StageModule(PipelineParts(blocks=(part,) if part is not None else parts.blocks[:1]), 0, 1,
                                       is_first=True, is_last=True)).to(device)
    probing = on.for_probe()
    stage = MeteredStage(module, 0, 1, device, group=group, stage_hooks=probing,
                         flight=Flight(param_storage_ptrs(module), count_bytes=probing.counts_bytes), precision=precision)
    # Any scalar of the output stands in for the user's loss; timing the last part, it is a metered
    # piece of its own, as the runtime's last stage meters it (pipeline_stage.RowLoss).
    def loss(out, _t):
        return (stage.timed(lambda: out.float().square().mean()) if part is not None and part is parts.last
                else out.float().square().mean())

    schedule = ScheduleGPipe(stage, micro_batches, loss_fn=loss, scale_grads=False)
    inputs = x.repeat(micro_batches, *([1] * (x.dim() - 1)))
    target = torch.zeros(micro_batches * x.shape[0], device=device)
    cuda = device.type == "cuda"

    def step(i: int) -> tuple[float, float]:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            stage.begin_step(i, micro_batches)
            before, t0 = stage.compute_s, clocks.host()
            cpu0, pieces0, c0 = stage.cpu_s, stage.pieces, clocks.thread_cpu()
            schedule.step(inputs, target=target, losses=[], return_outputs=False)
            clocks.synchronize(device)    # kernels run after their launch: the step's synchronised wall time
            spent = clocks.host() - t0 if cuda else stage.compute_s - before
            outside = (clocks.thread_cpu() - c0) - (stage.cpu_s - cpu0)
            module.zero_grad(set_to_none=True)
        return spent / micro_batches, max(0.0, outside) / max(1, stage.pieces - pieces0)
    return step


def _block_input(parts, example: torch.Tensor, device: torch.device, precision) -> torch.Tensor:
    """What the first block takes: the example through `first` (a copy, on the device), in fp32
    as activations cross stages."""
    from .blocks import stage_autocast, to_fp32

    x = example.to(device)
    if parts.first is None:
        return x
    with torch.no_grad(), stage_autocast(precision, device.type):
        return to_fp32(copy.deepcopy(parts.first).to(device)(x))
