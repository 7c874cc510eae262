"""Resilience on a real CUDA device: a real CUDA out-of-memory error is recovered (micro-batch
halved, step redone, new size in the Plan), and a checkpoint written from CUDA tensors resumes.
Skipped without CUDA, with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Checkpoints, Rebalancing, Reporting

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: a real allocator out-of-memory error and CUDA tensors "
                                        "in torch.distributed.checkpoint")]

WIDTH, TOKENS = 1024, 64        # a sample is 64 rows: its activations, not the weights, fill memory
# Saved for backward per sample, fp32: every Linear's and GELU's input (W, 4W, 4W, W, W, 4W, 4W, W).
ACTIVATIONS = TOKENS * 20 * WIDTH * 4


def net():
    W = WIDTH
    return torch.nn.Sequential(torch.nn.Linear(W, 4 * W), torch.nn.GELU(), torch.nn.Linear(4 * W, W), torch.nn.GELU(),
                               torch.nn.Linear(W, 4 * W), torch.nn.GELU(), torch.nn.Linear(4 * W, W),
                               torch.nn.Linear(W, 1))


def job(steps: int, *, micro: int, ckpt: str | None = None, fraction: float | None = None):
    import hetrain
    from hetrain.planning.plan import DevicePlan, Plan

    if fraction is not None:   # a small card: cap this process's share of the GPU's memory
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    plan = Plan(global_batch=512, devices=(DevicePlan(rank=0, device="cuda:0", speed=1.0, share=512,
                                                      micro_batch=micro),))
    ht = hetrain.init(global_batch=512, max_steps=steps, plan=plan, precision="fp32",
                      reporting=Reporting(verbose=False), checkpoints=Checkpoints(dir=ckpt, every=2),
                      rebalancing=Rebalancing(enabled=False))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, TOKENS, WIDTH, generator=g)
    data = torch.utils.data.TensorDataset(x, x[..., :1])
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt, batches = ht.prepare(model, opt, data)
    for step in batches:
        for mb in step:
            with mb:
                xb, yb = mb.batch
                ht.backward(F.mse_loss(model(xb), yb))
        ht.step()
    out = {"params": [p.detach().cpu() for p in model.parameters()], "plan": ht.plan, "ooms": ht.ooms}
    ht.close()
    return out


def oom_worker(rank, world):
    total = torch.cuda.get_device_properties(0).total_memory
    # 0.13 GiB of model state (fp32 parameters and gradients, 16.8M) and 5 MiB of activations a
    # sample: the cap leaves room for about 128 samples' activations and 0.5 GiB of workspace, so
    # the planned micro-batch of 512 (2.5 GiB of activations) runs out of memory for real.
    state = 2 * 4 * sum(p.numel() for p in net().parameters())
    cap = state + 128 * ACTIVATIONS + 512 * 1024**2
    oom = job(2, micro=512, fraction=min(0.9, cap / total))
    clean = job(2, micro=64)
    return oom, clean


def test_a_real_cuda_oom_halves_the_micro_batch_and_keeps_the_result():
    ((oom, clean),) = run_ranks(oom_worker, 1, timeout=600)
    assert oom["ooms"] >= 1 and oom["plan"].devices[0].micro_batch < 512 and oom["plan"].version >= 1
    assert max((a - b).abs().max().item() for a, b in zip(oom["params"], clean["params"])) <= 1e-4


def resume_worker(rank, world, ckpt):
    first = job(2, micro=128, ckpt=ckpt)       # writes step-2 from CUDA tensors
    resumed = job(4, micro=128, ckpt=ckpt)     # resumes at step 2
    straight = job(4, micro=128)
    return first, resumed, straight


def test_checkpoint_from_cuda_resumes_to_the_same_parameters(tmp_path):
    ((_, resumed, straight),) = run_ranks(resume_worker, 1, str(tmp_path), timeout=600)
    assert max((a - b).abs().max().item() for a, b in zip(resumed["params"], straight["params"])) <= 1e-6
