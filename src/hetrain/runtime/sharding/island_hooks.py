"""Data parallel across device islands: DDP's gradient all-reduce as a hierarchical one, in a
communication hook (DistributedDataParallel.register_comm_hook).

For a bucket of S bytes, with islands of n ranks each (runtime/ranks/islands.py; the sharded form):
  1. reduce-scatter inside the island, on its native group: each rank holds the island's sum of
     its 1/n shard (the bucket padded with zeros to a multiple of n);
  2. all-reduce that shard over the bridge, with the matching rank of every other island (gloo,
     staged through host memory: runtime/ranks/islands.py bridge_all_reduce);
  3. all-gather inside the island: every rank holds the whole sum.
Islands of different sizes have different shard boundaries, so there the leaders' form runs: reduce
to the island's leader, the leaders all-reduce the whole bucket over the bridge, broadcast back.
Both divide by the world size first, as DDP's own all-reduce does, so hetrain's loss weighting
W·n/B (runtime/loop/reduce.py) gives the big-batch gradient through them as through plain DDP.

What overlaps. The hook hands the bucket to one worker thread of this rank and returns a future at
once; the backward goes on computing the next buckets while the worker runs this one's three steps
(a modelled link's time included: ranks/islands.py Islands.link). One thread, buckets in the order
DDP launched them: every rank issues the native and bridge collectives in the same order (two
threads could interleave two buckets' collectives differently on two ranks, and gloo would pair
the wrong ones). So buckets overlap the backward, not each other; the optimizer waits for the last
(DDP's finalize).

OOM recovery, rebalancing, resume. The hook has GradientHook's interface (comm_hooks.py): OOM recovery's SyncGuard calls it for every bucket and completes
an interrupted backward by calling it on zero buckets, which run the same three steps, so the
peers of every island meet what they wait for. Rebalancing and resume change only the shares
and micro-batches, which the hook never reads (it sums whatever each rank computed). It keeps no
state across steps: nothing to keep for a redo, nothing to checkpoint.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from ..devices import clock as clocks
from ..ranks.islands import IslandGroups, bridge_all_reduce, make_groups, native_run
from ..ranks.torch_compat import all_gather_single, reduce_scatter_single


class IslandSync:
    """A bucket's sum over every rank, hierarchically, divided by the world size."""

    compression = "none"
    needed = True

    def __init__(self, groups: IslandGroups, *, world_size: int, device: torch.device):
        self.groups = groups
        self.world_size = world_size
        self.device = torch.device(device)
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self.buckets = 0                      # buckets summed, in all

    def __call__(self, bucket) -> torch.futures.Future:
        clocks.sync_point()       # the device's queued work first (nothing on a device that queues none)
        return self.reduce(bucket.buffer())

    @staticmethod
    def ddp_hook(self, bucket):   # unannotated: DDP rejects string annotations (postponed evaluation)
        return self(bucket)

    def reduce(self, buffer: torch.Tensor) -> torch.futures.Future:
        """`buffer` summed over the job (in place) on the worker thread; the future's value is it."""
        cuda = self.device.type == "cuda"
        future = torch.futures.Future(devices=[self.device]) if cuda else torch.futures.Future()
        ready = None
        if cuda:      # the worker's collectives start once the backward's kernels wrote the bucket
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="hetrain-island-sync", daemon=True)
            self._worker.start()
        self._queue.put((buffer, future, ready))
        return future

    def _work(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            buffer, future, ready = item
            try:
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
                self._sum(buffer)
                self.buckets += 1
            except BaseException as e:   # noqa: BLE001 — handed to DDP's wait, on the backward's thread
                future.set_exception(e)
                continue
            future.set_result(buffer)

    def _sum(self, buffer: torch.Tensor) -> None:
        g = self.groups
        buffer.div_(self.world_size)
        n = len(g.native_ranks)
        nbytes = float(buffer.numel() * buffer.element_size())
        if not g.islands.sharded:
            if n > 1:
                native_run(g, lambda: dist.reduce(buffer, dst=g.leader, group=g.native), nbytes / 2)
            if g.bridge is not None:
                bridge_all_reduce(buffer, g)
            if n > 1:
                native_run(g, lambda: dist.broadcast(buffer, src=g.leader, group=g.native), nbytes / 2)
            return
        if n == 1:
            bridge_all_reduce(buffer, g)
            return
        flat = buffer.view(-1)
        pad = -flat.numel() % n
        padded = torch.cat([flat, torch.zeros(pad, dtype=flat.dtype, device=self.device)]) if pad else flat
        shard = torch.empty(padded.numel() // n, dtype=flat.dtype, device=self.device)
        # a reduce-scatter and an all-gather each move half an all-reduce's bytes
        native_run(g, lambda: reduce_scatter_single(shard, padded, group=g.native), nbytes / 2)
        bridge_all_reduce(shard, g)
        native_run(g, lambda: all_gather_single(padded, shard, group=g.native), nbytes / 2)
        if pad:
            flat.copy_(padded[:flat.numel()])

    def close(self) -> None:
        """Stop the worker thread once it has summed what it was given."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    # -- OOM recovery (runtime/resilience/oom.py SyncGuard): no state to keep or put back ----------
    def begin(self) -> None:
        """A step's last backward is about to run: nothing carried from step to step."""

    def redo(self) -> None:
        """The step is redone: nothing to put back."""


def attach_links(groups: IslandGroups) -> IslandGroups:
    """Where the islands' links are modelled (`Islands.link`): this rank's island group runs through
    the island's link, its bridge group through the bridge's (the island spec's figures; none
    named, none modelled)."""
    islands = groups.islands
    if islands.link is None:
        return groups
    gbs = islands.links_gbs.get(islands.island_of[groups.rank])
    if gbs and len(groups.native_ranks) > 1:
        groups.native_link = islands.link(gbs, len(groups.native_ranks))
    if islands.bridge_gbs and groups.bridge is not None:
        # The bridge is one host link per island (the spec names one: a NIC), which every shard's ring
        # crosses at once: n rings share it, each at 1/n (planning/bridge_cost.py prices the same).
        rings = len(islands.bridge_ranks())
        groups.bridge_link = islands.link(islands.bridge_gbs / rings, len(groups.bridge_ranks))
    return groups


def make(job, islands) -> IslandSync:
    """The job's groups (a collective) and the hook over them, the layout shown once."""
    if job.plan is not None and job.plan.compression != "none":     # not combined (yet): the plan says none
        from ...errors import HetrainError

        raise HetrainError(f"the plan in force says gradient compression {job.plan.compression}, which the "
                           "hierarchical all-reduce across islands does not run (layouts/complete.py records none)",
                           "this is a bug in hetrain; please report it with the log")
    from datetime import timedelta

    groups = attach_links(make_groups(islands, rank=job.rank, timeout=timedelta(seconds=job.config.timeout_s)))
    job.log.info(f"data parallel across islands: {islands.describe()}")
    return IslandSync(groups, world_size=job.world_size, device=job.device)
