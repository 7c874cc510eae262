"""Gradient compression on CUDA/NCCL, where bf16 is the choice ('auto' picks bf16 on NCCL;
torch's bf16_compress_hook cannot run on gloo): hetrain's gradient hook, inside OOM recovery's
SyncGuard, on a DDP module on cuda:0 in an NCCL group. One GPU is enough: a group of one rank
still runs every hook's casts and NCCL all-reduces, and the guard's zero buckets. Skipped
without CUDA, with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: NCCL and torch's bf16_compress_hook (gloo cannot run it)")]

# relative to each tensor's largest element: one rounding of 2^-8 (bf16) or 2^-11 (fp16), with room
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "none": 1e-6}


def worker(rank, world, compressions=("bf16", "fp16", "powersgd"), backend="nccl"):
    """Per compression: each of 4 steps' gradient error against one module's own gradient (relative
    to each tensor's largest element), buckets completed with zeros, buckets in all. One process
    group for all of them (one NCCL start-up)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetrain.runtime.resilience.oom import install
    from hetrain.runtime.sharding.comm_hooks import GradientHook

    cuda = backend == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, device_id=device if cuda else None)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g).to(device), torch.randn(64, 512, generator=g).to(device)
    out = {}
    for compression in compressions:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512)).to(device)
        reference = copy.deepcopy(model)
        ddp = DDP(model, device_ids=[0] if cuda else None)
        guard = install(ddp, GradientHook(compression, backend=backend), guard=True)
        errors = []
        for _ in range(4):                      # DDP rebuilds its buckets after the first
            guard.begin()
            ddp.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            reference.zero_grad()
            F.mse_loss(reference(x), y).backward()
            errors.append(max(((p.grad - r.grad).abs().max() / r.grad.abs().max()).item()
                              for p, r in zip(model.parameters(), reference.parameters())))
        guard.begin()
        completed = guard.complete_missing()     # every bucket, with zeros, as after an OOM
        out[compression] = (errors, completed, len(ddp.reducer._get_zeros_like_grad_buckets()))
        del ddp, guard
    dist.destroy_process_group()
    return out


def test_bf16_fp16_and_powersgd_hooks_run_on_nccl_inside_the_guard():
    (out,) = run_ranks(worker, 1, timeout=300)
    for compression in ("bf16", "fp16"):
        errors, completed, buckets = out[compression]
        assert max(errors) <= TOLERANCE[compression], (compression, errors)
        assert max(errors) > 1e-7, (compression, errors)          # the cast really happened
        assert completed == buckets >= 1
    errors, completed, buckets = out["powersgd"]                 # 2 steps sent whole, then approximated
    assert max(errors[:2]) <= 1e-6 and errors[2] > 1e-4, errors
    assert completed == buckets >= 1
