"""Joining and leaving the process group, reliably, with or without torchrun.

Two traps, measured with torch 2.13 + gloo on CPU, shape this module:
  * After a torchrun restart, gloo workers read the previous attempt's addresses from the agent's
    shared TCPStore and fail in connectFullMesh (pytorch#135712). Every attempt therefore gets its
    own key space: PrefixStore(f"hetrain/attempt{TORCHELASTIC_RESTART_COUNT}", store).
  * Gloo can abort at interpreter exit ("terminate called without an active exception") while a
    DDP module is alive. `shutdown` releases the DDP modules first, then barriers and destroys.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import UsageError
from .torch_compat import abort_process_groups


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    restart: int                  # torchrun restart attempt (0 on the first run)
    owns_group: bool              # we created the process group (and so destroy it)
    local_world_size: int = 1     # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int, *, low: int = 0) -> int:
    """A torchrun variable as an int; junk is a UsageError naming it (raised after the error hook
    is installed, so it is one line, not a traceback)."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low:
        raise UsageError(f"the environment variable {name}={value!r} is not a whole number >= {low}",
                         f"unset {name}, or launch with torchrun / `hetrain run`, which set it")
    return number


def env_rank() -> tuple[int, int]:
    """(rank, world size) as far as the environment says, for the error hook before the process
    group exists; junk reads as rank 0 of 1 (init_distributed then says what is wrong)."""
    try:
        return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1, low=1)
    except ValueError:
        return 0, 1


def cuda_asked_for() -> bool:
    """CUDA_VISIBLE_DEVICES names GPUs: the job is meant for them, even where torch sees none
    ('' or '-1' hides them all: the CPU is meant)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return bool(visible) and not visible.startswith("-")


def check_cuda_device(local_rank: int) -> None:
    """The GPU this rank is to use exists: one line with the fix instead of CUDA's 'invalid device
    ordinal' at set_device. torchrun numbers LOCAL_RANK 0..n-1 on a node, so it fails where each
    process sees fewer GPUs (a scheduler's per-task CUDA_VISIBLE_DEVICES, say), or none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "CUDA_VISIBLE_DEVICES is unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
        raise UsageError(f"a GPU (cuda:{local_rank}) is asked for, but torch sees none here: torch "
                         f"{torch.__version__} with {build}, {shown}",
                         "run where `nvidia-smi` lists GPUs, with a CUDA build of torch; or, to train on the CPU, "
                         "unset CUDA_VISIBLE_DEVICES (`hetrain run --help`: a cluster spec's GPUs run on it)")
    if local_rank >= count:
        raise UsageError(f"LOCAL_RANK={local_rank} but this process sees {count} GPU(s) ({shown}): it "
                         f"would use cuda:{local_rank}",
                         f"start at most {count} process(es) per node (`hetrain run --nproc {count}`, torchrun "
                         f"--nproc-per-node={count}), or let each process see all the node's GPUs (no per-task "
                         "CUDA_VISIBLE_DEVICES, e.g. Slurm --gpus-per-node instead of --gpus-per-task)")


def init_distributed(*, timeout_s: float, use_cuda: bool) -> DistContext:
    """Join the job's process group (torchrun env vars), or make a group of one."""
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1, low=1)
    local_rank = _env_int("LOCAL_RANK", 0)
    restart = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if rank >= world:
        raise UsageError(f"RANK={rank} but WORLD_SIZE={world}: RANK must be below WORLD_SIZE",
                         "launch with torchrun / `hetrain run`, which set both")
    if use_cuda:
        check_cuda_device(local_rank)
        # Before anything else touches CUDA, or every rank makes a context on GPU 0.
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"

    if dist.is_initialized():  # the user made the group; use it as it is
        size = dist.get_world_size()
        # torchrun's variables describe the user's group only when they name its size (a group of
        # one made beside them, say, is a node of one)
        same = _env_int("WORLD_SIZE", size, low=1) == size
        return DistContext(dist.get_rank(), size, local_rank if same else 0, device,
                           dist.get_backend(), restart, owns_group=False,
                           local_world_size=_env_int("LOCAL_WORLD_SIZE", size, low=1) if same else size)

    timeout = datetime.timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if world == 1 and "MASTER_ADDR" not in os.environ:
        store: dist.Store = dist.HashStore()
    else:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _env_int("MASTER_PORT", 29500, low=1)
        store = dist.TCPStore(host, port, world_size=world, is_master=(not agent and rank == 0),
                              timeout=timeout, wait_for_workers=False)
    # On the agent's store (one node: torchrun's shared store outlives attempts) each attempt gets
    # its own keys. A store of our own (multi-node launches make one per round, on a new port) is
    # fresh already, and the nodes' restart counts differ (a node that joins later starts at 0), so
    # its keys must not depend on them.
    own = isinstance(store, dist.TCPStore) and not agent
    store = dist.PrefixStore("hetrain/round" if own else f"hetrain/attempt{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    return DistContext(rank, world, local_rank, device, backend, restart, owns_group=True,
                       local_world_size=_env_int("LOCAL_WORLD_SIZE", world, low=1))


def leave_after_error(ctx: DistContext | None) -> str | None:
    """Leave the group when the job did not end with close() (an error, or an exit without it): no
    barrier, peers may be gone. NCCL's communicators are aborted: destroy_process_group shuts them
    down and can wait for ever on a collective a lost peer never joins; an abort does not wait.
    gloo's group is destroyed as on a clean exit. Returns how the group was left (None: not ours)."""
    if ctx is None or not ctx.owns_group or not dist.is_initialized():
        return None
    if "nccl" in ctx.backend:
        return abort_process_groups()
    dist.destroy_process_group()
    return "destroy_process_group"


def shutdown(ctx: DistContext | None) -> None:
    """Leave the group cleanly. Callers drop their DDP modules before calling this."""
    gc.collect()
    if ctx is not None and ctx.owns_group and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
