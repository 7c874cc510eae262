"""How much longer a block takes as a pipeline stage runs it than alone, measured where a pipeline is
sized (layouts/pipeline_setup.measure_blocks: in `hetrain plan`, and in a job unless the cache has
it).

The pipeline model (planning/pipeline_split.py) costs a stage's micro-batch from its blocks, timed
one by one (parallel/blocks.profile_blocks). A stage runs more than its blocks: the pipelining
schedule's forward_one_chunk and backward_one_chunk (argument flattening, detaching the inputs,
stage_backward's autograd call), hetrain's metering around each piece (its autocast, the saved-bytes
count on emulated devices, a hook per saved tensor) and, on an emulated device, the sleep after
every piece, which leaves the next piece on cold caches. Most of that is per op, so it grows with
the blocks a stage holds and not with the micro-batch's rows. Measured on the demo GPT (4 blocks of
d=128, micro-batches of 4, an AMX Xeon, fp32, emulated speeds 0.5 and 0.335): the whole model as a
one-stage pipeline took 6.62 ms a micro-batch beyond its blocks' ~14.9, its first block alone 1.76
ms beyond its 3.46; the ranking, which had stretched the blocks by the whole model's fixed cost per
micro-batch, predicted the 2-stage pipeline 44% too fast (bf16). So each rank times the first block
as a one-stage pipeline (a copy: the job's model is left as it was; one block, as the model may not
fit one device), fed what `first` makes of the example, at 1 row and at the example's µ rows, and
fits

    t(µ) = block_s + stage_factor · µ · s         (s: the block's profiled seconds a row)

(the same host and model: x1.05 + 1.02 ms a block in fp32, x0.92 + 1.89 ms in bf16, whose autocast
adds work per op). It runs on a process group of its own rank, under its device's autocast and,
emulated, a throttle of its own device's speed (a fresh one: the job's throttle keeps its books). A
piece's time is its wall time less its throttle sleep, as the runtime meters it
(pipeline_stage.MeteredStage.timed); on CUDA, whose pieces return before their kernels finish, the
step's synchronised wall time. The ranks measure one at a time, as the blocks are measured (a
whole-model version of this probe, four ranks on 2 cores, fp32, read 10.7 ms a micro-batch all at
once and 5.4-7.5 ms in turn: contention, which the pipeline model does not play out), and the ranks'
medians are kept: the same figures on every rank.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

from ..ranks import agree

STEPS = 4             # timed steps, after one warm-up


def time_stage_cost(parts, profile, example: torch.Tensor, *, device: torch.device, micro_batches: int = 8,
                    precision=None, speed: float | None = None, steps: int = STEPS) -> dict:
    """How a stage runs a block, against the block's profiled time s (a collective: every rank
    calls it with the same parts): a micro-batch of µ rows takes o + f·µ·s, o seconds per block
    whatever µ (the per-op work around it) and f·s per row. Timed at µ = 1 and µ = the rows of
    `example` (one micro-batch of inputs); `profile`: the parts' costs (profile_blocks); `speed`:
    an emulated device's speed (None: a real device, no throttle). Returns {"factor", "block_s",
    "ranks" (each rank's (factor, block_s)), "micro_batch", "micro_batches", "steps"}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]      # every rank creates every group, in order
    x = _block_input(parts, example, device, precision)
    big = int(x.shape[0])
    sizes = (1, big) if big > 1 else (1,)
    times = {}
    for turn in range(world):     # one rank at a time (see the module's note), the others wait
        if turn == rank:
            times = {mu: _time_block(parts, x[:mu], device=device, micro_batches=micro_batches, group=solo,
                                     precision=precision, speed=speed, steps=steps) for mu in sizes}
        dist.barrier()
    s = profile.blocks[0].seconds
    if len(sizes) == 2 and s > 0:     # the line through both sizes: slope f·s, intercept o
        factor = max((times[big] - times[1]) / ((big - 1) * s), 1e-3)
        block_s = max(times[1] - factor * s, 0.0)
    else:
        factor, block_s = (times[1] / s if s > 0 else 1.0), 0.0
    table = agree.exchange({"factor": factor, "block_s": block_s}, rank=rank, world_size=world, device=device)
    ranks = list(zip(table.column("factor"), table.column("block_s")))
    return {"factor": statistics.median(f for f, _ in ranks), "block_s": statistics.median(b for _, b in ranks),
            "ranks": ranks, "micro_batch": big, "micro_batches": micro_batches, "steps": steps}


def _time_block(parts, x: torch.Tensor, *, device, micro_batches: int, group, precision, speed, steps: int) -> float:
    """Median seconds per micro-batch of x's rows of the first block run as a one-stage pipeline."""
    from torch.distributed.pipelining import ScheduleGPipe

    from ..devices.emulation import Throttle
    from ..parallel.blocks import PipelineParts, StageModule, param_storage_ptrs
    from ..parallel.pipeline_stage import Flight, MeteredStage

    # One block, as a stage of its own: the model need not fit one device (why it is pipelined).
    module = copy.deepcopy(StageModule(PipelineParts(blocks=parts.blocks[:1]), 0, 1, is_first=True,
                                       is_last=True)).to(device)
    throttle = Throttle(speed) if speed is not None else None
    stage = MeteredStage(module, 0, 1, device, group=group, throttle=throttle,
                         flight=Flight(param_storage_ptrs(module), count_bytes=speed is not None), precision=precision)
    # Any scalar of the output stands in for the user's loss: its cost is part of the last piece.
    schedule = ScheduleGPipe(stage, micro_batches, loss_fn=lambda out, _t: out.float().square().mean(),
                             scale_grads=False)
    inputs = x.repeat(micro_batches, *([1] * (x.dim() - 1)))
    target = torch.zeros(micro_batches * x.shape[0], device=device)
    cuda = device.type == "cuda"
    per_micro = []
    with torch.random.fork_rng(devices=[device] if cuda else []):
        for i in range(steps + 1):
            stage.begin_step(i, micro_batches)
            before, t0 = stage.compute_s, time.perf_counter()
            schedule.step(inputs, target=target, losses=[], return_outputs=False)
            if cuda:          # kernels run after their launch: the step's synchronised wall time
                torch.cuda.synchronize(device)
            spent = time.perf_counter() - t0 if cuda else stage.compute_s - before
            module.zero_grad(set_to_none=True)
            if i:                     # the first builds the stage's buffers
                per_micro.append(spent / micro_batches)
    return statistics.median(per_micro)


def _block_input(parts, example: torch.Tensor, device: torch.device, precision) -> torch.Tensor:
    """What the first block takes: the example through `first` (a copy, on the device), in fp32
    as activations cross stages."""
    from ..parallel.blocks import stage_autocast, to_fp32

    x = example.to(device)
    if parts.first is None:
        return x
    with torch.no_grad(), stage_autocast(precision, device.type):
        return to_fp32(copy.deepcopy(parts.first).to(device)(x))
