"""The emulated inter-node link: emulated devices on several "nodes" of one host talk over
loopback, which is as fast as memory; `emulate_link_gbs` makes the collectives that cross the node
boundary last what a link of that bandwidth would take.

What is slowed: every gradient all-reduce (the DDP communication hook, runtime/sharding/comm_hooks.py)
and the link probes (runtime/measure/sync_probes.py), only on emulated devices of a job that spans
nodes; never on real GPUs, whose link is real. How long: a ring all-reduce of the S bytes actually
sent (compressed ones included, so compression shows its gain) over the slowest link,
2(n−1)/n · S/B (planning/collectives.py `allreduce_seconds`, no latency), n the ring's ranks. When:
after the collective has completed, only the part of that time the loopback transfer did not
already take, so the emulated time is the link's and not the link's plus loopback's. The sleep
runs in the collective's completion (a future's `then`, on gloo a worker thread of the process
group), so the backward goes on computing while an early bucket is "on the wire", as on a real
link, and only what is left after the backward is exposed. Transfers share the link: one that
starts while another is on it waits for it (`_free_at`), whatever thread completes them.

A rank that arrives late at a collective finds it complete at once and sleeps the link's whole
time; its peers, who waited for it, sleep what is left: every rank leaves the collective at the
late rank's arrival plus the link's time, as over a real link.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..runtime.devices import clock as clocks
from ..planning.collectives import Link, allreduce_seconds


class LinkThrottle:
    """A link of `gbs` GB/s under a ring of `ring` ranks."""

    def __init__(self, *, gbs: float, ring: int):
        self.link = Link(bandwidth_gbs=gbs, latency_s=0.0, source=f"emulated: {gbs:g} GB/s (emulate_link_gbs)")
        self.ring = ring
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.slept_s = 0.0           # added by the throttle, in all
        self.sent_bytes = 0.0        # what crossed it

    def seconds(self, nbytes: float) -> float:
        """What an all-reduce of `nbytes` takes on this link."""
        return allreduce_seconds(self.ring, nbytes, self.link)

    def finish(self, started: float, nbytes: float) -> float:
        """A collective of `nbytes`, launched at `started` (clocks.host), has completed:
        sleep until the emulated link would have carried it. Returns that moment."""
        with self._lock:
            due = max(started, self._free_at) + self.seconds(nbytes)
            self._free_at = due
            self.sent_bytes += nbytes
        left = due - clocks.host()
        if left > 0:
            time.sleep(left)
            with self._lock:
                self.slept_s += left
        return due

    def then(self, future, started: float, nbytes: float):
        """`future` (a collective's, or a comm hook's), completing only once the link has carried it."""
        def carried(done):
            value = done.value()            # an error is raised at once, without the sleep
            self.finish(started, nbytes)
            return value
        return future.then(carried)

    def run(self, collective: Callable[[], object], nbytes: float) -> None:
        """A blocking collective of `nbytes`, through the link."""
        started = clocks.host()
        collective()
        self.finish(started, nbytes)


def throttle_for(job, *, ring: int | None = None) -> LinkThrottle | None:
    """The job's emulated inter-node link for a ring of `ring` ranks (default: all of them), or
    None: no emulate_link_gbs, real GPUs, or one node (its devices' link is not emulated)."""
    gbs = job.config.emulation.link_gbs
    nodes = job.nodes
    if gbs is None or getattr(job.hooks, "emulated", None) is None or nodes is None or not nodes.spans_nodes:
        return None
    return LinkThrottle(gbs=gbs, ring=ring or job.world_size)


def check_link_request(job) -> None:
    """emulate_link_gbs where it cannot act: on real GPUs an error (every rank: all or none
    emulate, runtime/ranks/nodes.py), on one node a warning that it does nothing."""
    from ..errors import UsageError

    gbs = job.config.emulation.link_gbs
    if gbs is None:
        return
    if getattr(job.hooks, "emulated", None) is None:
        raise UsageError(f"Emulation(link_gbs={gbs:g}) emulates the inter-node link of emulated devices, but this "
                         "job runs on real devices (their link is real)",
                         "drop link_gbs (--emulate-link-gbs), or emulate the devices (--emulate SPEC)")
    if job.nodes is None or not job.nodes.spans_nodes:
        job.log.warn_job(f"Emulation(link_gbs={gbs:g}) does nothing here: it emulates the link between nodes, "
                         "and this job runs on one node")
