"""The hierarchical all-reduce across device islands on CUDA tensors: what CPU CI cannot check.
Two ranks on cuda:0, each its own island (native NCCL groups of one rank), joined by the gloo
bridge: every bucket is staged through pinned host memory, the hook's worker thread waits on an
event for the kernel that wrote the bucket (the bucket is a matmul's output, handed over at once),
and the future it returns is a CUDA-aware one. The result is compared with the two ranks' sum, in
float64. Skipped without CUDA, with the reason."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the bridge's host staging")]


def worker(rank, world):
    import torch.distributed as dist

    from hetrain.runtime.ranks.islands import Islands, make_groups
    from hetrain.runtime.sharding.island_hooks import IslandSync

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("gloo")
    islands = Islands(island_of=("nv", "amd"), backends={"nv": "nccl", "amd": "nccl"})
    groups = make_groups(islands, rank=rank)
    sync = IslandSync(groups, world_size=world, device=device)
    errors = []
    for size in (1, 1000, 1 << 20):
        g = torch.Generator().manual_seed(7)
        a = torch.randn(2, 512, generator=g, dtype=torch.float64).to(device)
        b = torch.randn(512, size, generator=g, dtype=torch.float64).to(device)
        expected = (a @ b).flatten() * 1.5                 # (1 + 2) · a@b over the 2 ranks
        bucket = ((a @ b) * (rank + 1)).flatten()          # a kernel still running when handed over
        got = sync.reduce(bucket).wait()
        errors.append((got.device.type, (got - expected).abs().max().item()))
    sync.close()
    out = {"errors": errors, "bridged": groups.bridged_bytes}
    dist.destroy_process_group()
    return out


def test_the_bridge_stages_cuda_buckets_through_host_memory():
    results = run_ranks(worker, 2, timeout=300)
    for r in results:
        assert all(kind == "cuda" and err <= 1e-9 for kind, err in r["errors"]), r
        assert r["bridged"] == 8 * 2 * (1 + 1000 + (1 << 20))
