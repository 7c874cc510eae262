"""The torch.distributed calls whose names or forms differ across the torch releases hetrain runs on
(pyproject.toml states the tested range), each chosen by asking the installed torch what it has.

  * The tensor-into-one-buffer collectives are `all_gather_single` / `reduce_scatter_single` from
    torch 2.13 on; before, only `all_gather_into_tensor` / `reduce_scatter_tensor`, which 2.13 keeps
    but deprecates (a FutureWarning per call). The newer one is taken where it exists.
  * Redoing an FSDP2 step an OOM broke needs `FSDPModule.reset_iter_state()` (torch 2.13 on). Without
    it in-loop OOM recovery under FSDP2 is off: an OOM ends the attempt, and --max-restarts resumes
    with the micro-batch halved, as under tensor parallelism.
  * Leaving after an error with NCCL work in flight: `destroy_process_group` shuts the communicators
    down and can wait on that work for ever; aborting them does not wait. torch's abort of every
    group at once (`distributed_c10d._abort_process_group`: 2.11, 2.13 and 2.14 have it) aborts them
    inside one NCCL group call, so one communicator's abort cannot block on another's (pytorch#119797);
    where it is missing, the default group's public `ProcessGroup.abort()`.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, *, group=None, async_op: bool = False):
    """Every rank's `input`, concatenated into `output` (world size × its elements)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, *, op=None, group=None, async_op: bool = False):
    """`input` reduced over the ranks (`op`, default sum), this rank's slice of it into `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


def fsdp_redoes_a_broken_step() -> bool:
    """Whether FSDP2 can be reset after an exception cut a forward or backward short."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "reset_iter_state")


def abort_process_groups() -> str:
    """Abort every communicator of this process without waiting for work in flight; afterwards
    torch.distributed is uninitialised where torch's abort-all exists. Returns which way was taken."""
    from torch.distributed import distributed_c10d

    abort_all = getattr(distributed_c10d, "_abort_process_group", None)
    if abort_all is not None:
        abort_all()
        return "abort_process_group"
    world = dist.group.WORLD
    if world is not None and hasattr(world, "abort"):
        world.abort()
        return "ProcessGroup.abort"
    dist.destroy_process_group()
    return "destroy_process_group"
