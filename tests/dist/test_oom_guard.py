"""The OOM guard's completion of a broken gradient sync: one bucket's zeros at a time, and a
bucket counts as launched only once its hook issued it."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks

pytestmark = pytest.mark.dist


def complete_worker(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetrain.emulation.device import MemoryMeter
    from hetrain.runtime.resilience.oom import SyncGuard
    from hetrain.runtime.sharding.comm_hooks import GradientHook

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    ddp = DDP(net, bucket_cap_mb=0.1)
    guard = SyncGuard(ddp, GradientHook("none"))
    meter = MemoryMeter(label="dev", cap=None)
    for _ in range(2):          # the second backward runs on the rebuilt buckets
        guard.begin()
        ddp(torch.randn(4, 128)).sum().backward()
    sizes = [b.buffer().numel() * 4 for b in ddp.reducer._get_zeros_like_grad_buckets()]
    launched = list(guard.launched)
    ddp(torch.randn(4, 128))    # the next forward arms the reducer; its backward "fails" at once
    guard.begin()
    with meter.allocating():     # every storage the completion allocates, and the most held at once
        count = guard.complete_missing()
    result = {"sizes": sizes, "launched": launched, "count": count, "peak": meter.ledger.recovery_peak}
    del guard, ddp
    dist.barrier()
    dist.destroy_process_group()
    return result


def test_the_missing_buckets_are_completed_one_at_a_time():
    r0, r1 = run_ranks(complete_worker, 2)
    for r in (r0, r1):
        assert len(r["sizes"]) >= 3 and r["launched"] == list(range(len(r["sizes"])))
        assert r["count"] == len(r["sizes"])                 # every bucket owed, completed
        assert 0 < r["peak"] <= max(r["sizes"]) < sum(r["sizes"])   # never more than one bucket's zeros


def test_a_bucket_whose_hook_raised_is_still_owed():
    from hetrain.runtime.resilience.oom import SyncGuard

    class Raising:
        def __call__(self, bucket):
            raise torch.OutOfMemoryError("in the hook")

    class Bucket:
        def index(self):
            return 3

    guard = SyncGuard.__new__(SyncGuard)
    guard.gradient, guard.launched = Raising(), []
    with pytest.raises(torch.OutOfMemoryError):
        SyncGuard.hook(guard, Bucket())
    assert guard.launched == []
