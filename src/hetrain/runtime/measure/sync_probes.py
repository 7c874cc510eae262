"""The collective probes, run once every rank is known to have profiled (measure/joint.py):
the gradient sync a job leaves exposed, through a DDP module; one all-reduce of the gradient's
size (the link); the step's agreement table. Every rank enters each of them.

No collective is entered by some ranks and skipped by others: local work that can fail (the
user's forward, loading the probe batch) runs under try, and `settle` then tells every rank
whether any failed before the next collective, so all raise the same error together. Collective
code itself is not wrapped: an exception there ends the process, and its peers' collective then
fails on the closed connection instead of waiting for a rank that has gone elsewhere."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable

import torch

from ..devices import clock as clocks
from ...errors import HetrainError
from ..devices.precision_policy import DTYPES
from ..user_objects import as_scalar, default_forward



def settle(error: BaseException | None, *, stage: str, device: torch.device) -> None:
    """After local work that may have failed, before the next collective: every rank learns
    whether any rank failed, and then all raise the same HetrainError, naming each failed rank
    and its cause. A collective (a failure flag through agree.exchange, then the causes)."""
    import torch.distributed as dist

    from ..ranks.agree import exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    table = exchange({"failed": float(error is not None)}, rank=rank, world_size=world, device=device)
    if not table.any("failed"):
        return
    causes = [None] * world
    mine = None if error is None else f"{type(error).__name__}: {getattr(error, 'what', error)}"
    dist.all_gather_object(causes, mine)
    failed = "; ".join(f"rank {r}: {c}" for r, c in enumerate(causes) if c is not None)
    raise HetrainError(f"measuring the gradient sync failed in {stage} ({failed})",
                       "fix the cause, or pass hetrain.init(plan=...) to run a saved plan without measuring")


def time_gradient_sync(ddp, batch, *, forward: Callable = default_forward,
                       device: torch.device, precision: str = "fp32",
                       runs: int = 5, link=None) -> tuple[list[float], list[float] | None, list[float] | None,
                                                          list[float] | None]:
    """Seconds of gradient sync DDP leaves exposed after the backward, once per run, for the
    micro-batch `batch`, as this job's devices, link and (on a shared host) shared cores
    give it; on the CPU also each run's seconds of forward+backward before the sync (all ranks
    start together, so the ranks' spread measures straggling) and, each run beside it, the seconds
    of the same forward+backward through the bare module (no DDP), every rank at once too, and
    the ratio of the two runs' CPU time on this thread (the DDP run's to its last bucket's launch):
    DDP's own CPU on the thread that runs the device's compute (its hooks, bucket copies and
    launches), which the host's other load, paid alike by both, does not move. Returns (exposed
    sync, compute, bare compute, DDP's CPU over the bare run's), one per run; on CUDA the last
    two are None. A collective: every rank calls it
    (`ddp` fresh: a comm hook is registered on it). Gradients, buffers and RNG are left as found.
    The warm-up's forward runs locally (no buffer broadcast) and its outcome is settled on every
    rank before the first backward's all-reduce: the user's forward failing on one rank raises
    the same HetrainError on all. The timed runs are not wrapped (see the module docstring).

    On a GPU: a synchronised backward's wall time beyond one under no_sync(). On the CPU that
    difference of two runs is mostly the noise of processes sharing cores (6–26 ms measured for one
    job), so the tail itself is timed: from the moment the last bucket's all-reduce is launched (the
    backward's compute is done) to the moment backward() returns with every gradient reduced.

    `link`: what every bucket's all-reduce crosses beyond the transport, as in training
    (DeviceMeasuring.link; None: the transport alone)."""
    import torch.distributed as dist

    from ..sharding.comm_hooks import GradientHook

    module = ddp.module
    dtype = DTYPES.get(precision)
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    cuda = device.type == "cuda"
    last_launch: list[tuple[float, float]] = []
    if not cuda:
        gradient = GradientHook("none")     # training's all-reduce

        def hook(state, bucket):
            if bucket.is_last():      # on the CPU DDP runs its hooks on the backward's own thread
                last_launch.append((clocks.host(), clocks.thread_cpu()))
            if link is None:
                return gradient(bucket)
            started, buffer = clocks.host(), bucket.buffer()      # through the link, as training's hook sends it
            return link.then(gradient(bucket), started, float(buffer.numel() * buffer.element_size()))
        ddp.register_comm_hook(None, hook)

    def once(sync: bool) -> tuple[float, float, float]:
        """(seconds to the last bucket's launch, seconds from there to the end, this thread's CPU
        seconds to the launch); on CUDA (0, the whole forward+backward, 0)."""
        dist.barrier()                        # start together, as ranks do after a step's sync
        clocks.synchronize(device)
        t0, c0 = clocks.host(), clocks.thread_cpu()
        last_launch.clear()
        with (contextlib.nullcontext() if sync else ddp.no_sync()):
            with (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()):
                loss = as_scalar(forward(ddp, batch))
            loss.backward()
        clocks.synchronize(device)
        end = clocks.host()
        launched, cpu = last_launch[-1] if last_launch else (t0, c0)     # the hook runs on the CPU only
        return launched - t0, end - launched, cpu - c0

    def bare() -> tuple[float, float]:
        """(seconds, this thread's CPU seconds) of the forward+backward through the bare module,
        every rank at once (CPU only)."""
        dist.barrier()
        t0, c0 = clocks.host(), clocks.thread_cpu()
        with (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()):
            loss = as_scalar(forward(module, batch))
        loss.backward()
        return clocks.host() - t0, clocks.thread_cpu() - c0

    def warm_up() -> None:
        """A synchronised forward+backward, untimed (the first sync also rebuilds DDP's buckets),
        whose forward is local and settled before its backward's collectives."""
        dist.barrier()
        error, broadcast = None, ddp.broadcast_buffers
        ddp.broadcast_buffers = False         # DDP's forward would broadcast buffers: a collective
        try:
            with (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()):
                loss = as_scalar(forward(ddp, batch))
        except Exception as e:     # noqa: BLE001 — settled on every rank just below
            error = e
        finally:
            ddp.broadcast_buffers = broadcast
        settle(error, stage="the probe's forward", device=device)
        loss.backward()

    with torch.random.fork_rng(devices=[device] if cuda else []):
        warm_up()
        if cuda:
            exposed, compute, plain, ratio = [once(True)[1] - once(False)[1] for _ in range(runs)], None, None, None
        else:
            bare()                            # its first pass (the DDP one warmed up above)
            timed = [(*once(True), *bare()) for _ in range(runs)]
            compute, exposed, ddp_cpu, plain, bare_cpu = (list(column) for column in zip(*timed))
            ratio = [d / b if b > 0 else 0.0 for d, b in zip(ddp_cpu, bare_cpu)]
    module.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, b in module.named_buffers():
            b.copy_(buffers[n])
    return [max(0.0, x) for x in exposed], compute, plain, ratio


def time_agreement(device: torch.device, *, runs: int = 5) -> float:
    """Seconds of the small all-reduce hetrain adds to every step (agree.exchange of the step's
    values, agree.STEP_KEYS), with the ranks arriving together as they do after the gradient
    sync: median of `runs`. A collective."""
    import torch.distributed as dist

    from ..ranks.agree import STEP_KEYS, exchange

    values = dict.fromkeys(STEP_KEYS, 0.0)
    return _median_seconds(lambda: exchange(values, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                            device=device), device, runs=runs, barrier=True)


def time_allreduce(nbytes: int, device: torch.device, *, runs: int = 3, group=None, link=None) -> float:
    """Seconds of one all-reduce of `nbytes` (median of `runs`, after a warm-up) among `group`
    (None: every rank), through `link` when given (DeviceMeasuring.link). A collective: every rank
    of the group calls it. This measures the link, not the device, so it is kept out of `measure`."""
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    if link is None:
        return _median_seconds(lambda: dist.all_reduce(buf, group=group), device, runs=runs)
    sent = buf.numel() * buf.element_size()
    return _median_seconds(lambda: link.run(lambda: dist.all_reduce(buf, group=group), sent), device, runs=runs)


def time_inter_node_allreduce(nbytes: int, device: torch.device, *, leaders, rank: int, timeout_s: float,
                              link=None, runs: int = 3) -> float:
    """Seconds of one all-reduce of `nbytes` among the nodes' leaders only (their lowest ranks,
    runtime/ranks/nodes.py): the link between the nodes, without the links inside them. A
    collective: every rank makes the group (torch's new_group), the leaders time it; the others
    return 0 at once (and wait at the next collective)."""
    import datetime

    import torch.distributed as dist

    group = dist.new_group(list(leaders), timeout=datetime.timedelta(seconds=timeout_s))
    if rank not in leaders:
        return 0.0
    try:
        return time_allreduce(nbytes, device, runs=runs, group=group, link=link)
    finally:
        dist.destroy_process_group(group)


def _median_seconds(collective: Callable[[], object], device: torch.device, *, runs: int,
                    barrier: bool = False) -> float:
    """Median seconds of `runs` calls of `collective`, after one warm-up call; with `barrier`,
    the ranks start each call together."""
    import torch.distributed as dist

    times = []
    for k in range(runs + 1):
        if barrier:
            dist.barrier()
        clocks.synchronize(device)
        t0 = clocks.host()
        collective()
        clocks.synchronize(device)
        if k:
            times.append(clocks.host() - t0)
    return statistics.median(times)
