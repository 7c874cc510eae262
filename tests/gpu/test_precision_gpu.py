"""Precision, TF32/cuDNN and sharding on a real CUDA device: what the CPU emulation cannot show.
Skipped without CUDA, with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Reporting

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: real compute capability, TF32/cuDNN switches, the CUDA "
                                        "allocator's peak and FSDP2 CPUOffloadPolicy (which fails on CPU: "
                                        "'Cannot access accelerator device')")]


def facts_worker(rank, world):
    import torch.distributed as dist

    from hetrain.errors import UsageError
    from hetrain.runtime.devices.precision_policy import PrecisionPolicy

    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    cc = torch.cuda.get_device_capability(device)
    policy = PrecisionPolicy.local("auto", device=device)
    policy.agree(rank=0, world_size=1, device=device)
    out = {"cc": cc, "precision": policy.name, "scaler": policy.scaler is not None,
           "tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
           "benchmark": torch.backends.cudnn.benchmark, "reason": policy.math.reason,
           "bf16_real": torch.cuda.is_bf16_supported(including_emulation=False)}
    a = torch.randn(64, 64, device=device)
    with policy.autocast("cuda"):
        out["autocast_dtype"] = (a @ a).dtype
    try:
        PrecisionPolicy.local("bf16", device=device).agree(rank=0, world_size=1, device=device)
        out["bf16_refused"] = None
    except UsageError as e:
        out["bf16_refused"] = e.what
    dist.destroy_process_group()
    return out


def test_auto_precision_tf32_and_cudnn_on_this_gpu():
    (out,) = run_ranks(facts_worker, 1)
    real = out["cc"] >= (8, 0)
    assert out["precision"] == ("bf16" if real else "fp16")
    assert out["bf16_real"] == real
    assert out["autocast_dtype"] == (torch.bfloat16 if real else torch.float16)
    assert out["scaler"] == (not real)
    assert out["tf32"] == out["cudnn_tf32"] == real and out["benchmark"] is True
    assert ("TF32 on" if real else "no TF32") in out["reason"]
    assert (out["bf16_refused"] is None) == real
    if not real:
        assert "compute capability" in out["bf16_refused"]


def offload_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))  # noqa: E731
    plain = make().cuda()
    torch.manual_seed(0)
    sharded = make()
    mesh = init_device_mesh("cuda", (1,))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(sharded, mesh=mesh, offload_policy=CPUOffloadPolicy())
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 1, device="cuda")
    F.mse_loss(plain(x), y).backward()
    F.mse_loss(sharded(x), y).backward()
    diffs = [(p.grad.cpu() - q.grad.to_local().cpu()).abs().max().item()   # one rank: the shard is whole
             for p, q in zip(plain.parameters(), sharded.parameters())]
    on_cpu = all(q.to_local().device.type == "cpu" for q in sharded.parameters())
    dist.destroy_process_group()
    return diffs, on_cpu


def test_fsdp2_cpu_offload_gives_the_same_gradients():
    (diffs, on_cpu), = run_ranks(offload_worker, 1)
    assert on_cpu
    assert max(diffs) < 1e-5


def engine_worker(rank, world, sharding):
    import hetrain

    ht = hetrain.init(global_batch=8, max_steps=2, precision="auto",
                      reporting=Reporting(verbose=False))
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model, opt, batches = ht.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data,
                                     parallel=hetrain.DataParallel(sharding=sharding))
    for step in batches:
        for mb in step:
            with ht.autocast():
                loss = F.mse_loss(model(mb.batch[0]).float(), mb.batch[1])
            ht.backward(loss)
        ht.step()
    summary = ht.summary()
    ht.close()
    return summary["precision"], summary["memory"]


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_engine_on_one_gpu_reports_allocator_peak(sharding):
    (prec, memory), = run_ranks(engine_worker, 1, sharding)
    cc = torch.cuda.get_device_capability(0)
    assert prec["per_rank"] == ["bf16" if cc >= (8, 0) else "fp16"]
    (row,) = memory
    assert row["measured"] > 0 and row["planned"] > 0
    assert row["cap"] == torch.cuda.get_device_properties(0).total_memory
