"""Pipeline and tensor parallelism on real GPUs (NCCL): the same equivalence as tests/dist, on
CUDA. Skipped without two CUDA devices (NCCL needs one GPU per rank)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Reporting

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs CUDA: 2 GPUs for a 2-rank NCCL pipeline / tensor-parallel group")]


def make():
    from hetrain.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 64, (10, 16), generator=g), torch.randint(0, 64, (10, 16), generator=g)


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def reference():
    model, x, y = make()
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def pipeline_worker(rank, world, schedule):
    """parallel='pp' through ht.prepare and the user's loop (tests/pipeline_runs.py), the demo GPT in
    float64 (autocast leaves float64 alone), on this rank's GPU, over NCCL (hetrain makes the group)."""
    from pipeline_runs import pipeline_plan, train

    plan = pipeline_plan("pp", blocks=(3, 1), schedule=schedule, shares=(10,), micro=(3,), world=world)
    return train("gpt", n=20, global_batch=10, steps=2, parallel=plan, grad_clip=0.05)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_on_two_gpus_matches_one_process(schedule):
    for r in run_ranks(pipeline_worker, 2, schedule, env={"OMP_NUM_THREADS": "4"}):
        assert r["device"] == "cuda" and r["backend"] == "nccl" and r["on_device"] and r["steps"] == 2, r
        # float64 on both sides; cuBLAS and the CPU's BLAS may round differently
        assert r["grad_error"] < 1e-8 and r["loss_error"] < 1e-8 and r["param_error"] < 1e-8, r


def tp_worker(rank, world):
    import hetrain
    from hetrain.runtime.layouts.tensor.shard import full_grad, tensor_parallel

    ref_loss, ref = reference()
    ht = hetrain.init(global_batch=10, reporting=Reporting(verbose=False))
    model, x, y = make()
    model = tensor_parallel(model.to(ht.device))
    loss = loss_fn(model(x.to(ht.device)), y.to(ht.device))
    loss.backward()
    err = max((full_grad(p).cpu() - ref[n]).abs().max().item() for n, p in model.named_parameters())
    ht.close()
    return {"grad_error": err, "loss_error": abs(loss.item() - ref_loss)}


def test_tensor_parallel_on_two_gpus_matches_one_process():
    for r in run_ranks(tp_worker, 2):
        assert r["grad_error"] < 1e-4 and r["loss_error"] < 1e-4, r
