"""Resilience on a real CUDA device: a real CUDA out-of-memory error in the last backward is
recovered (the failed graph released first, micro-batch halved, step redone, new size in the
Plan), and a checkpoint written from CUDA tensors resumes. The OOM is sized from the device's
free memory (`mem_get_info`): a ballast leaves room for the forward of 512 samples, not its backward.
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

WIDTH = 4096
OOM_WIDTH, OOM_ROWS = 1024, 64     # the OOM case: activations large next to the model (64 rows a sample)


def job(steps: int, *, micro: int, ckpt: str | None = None, width: int = WIDTH, rows: int = 0, watch=None):
    import hetrain
    from hetrain.planning.plan import DevicePlan, Plan

    plan = Plan(global_batch=512, devices=(DevicePlan(rank=0, device="cuda:0", speed=1.0, share=512,
                                                      micro_batch=micro),))
    ht = hetrain.init(global_batch=512, max_steps=steps, plan=plan, precision="fp32",
                      reporting=Reporting(verbose=False), checkpoints=Checkpoints(dir=ckpt, every=2),
                      rebalancing=Rebalancing(enabled=False))
    model, data = net_and_data(width, rows)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt, batches = ht.prepare(model, opt, data)
    if watch is not None:
        watch(ht)
    for step in batches:
        for mb in step:
            with mb:
                xb, yb = mb.batch
                ht.backward(F.mse_loss(model(xb), yb))
        ht.step()
    out = {"params": [p.detach().cpu() for p in model.parameters()], "plan": ht.plan, "ooms": ht.ooms}
    ht.close()
    return out


def net_and_data(width: int, rows: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, *((rows,) if rows else ()), width, generator=g)
    data = torch.utils.data.TensorDataset(x, x[..., :1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)], torch.nn.Linear(width, 1))
    return model, data


def peaks(micro: int) -> tuple[int, int]:
    """Reserved bytes above the baseline at the end of a forward of `micro` samples and over its
    backward, the model and its gradients included (as the job will hold them)."""
    model, data = net_and_data(OOM_WIDTH, OOM_ROWS)
    model = model.cuda()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    x, y = (t[:micro].cuda() for t in data.tensors)
    loss = F.mse_loss(model(x), y)
    torch.cuda.synchronize()
    forward = torch.cuda.max_memory_reserved() - base
    loss.backward()
    torch.cuda.synchronize()
    backward = torch.cuda.max_memory_reserved() - base
    del model, x, y, loss
    torch.cuda.empty_cache()
    return forward, backward


def oom_worker(rank, world):
    import hetrain.runtime.loop.stepping as stepping

    f512, b512 = peaks(512)
    _, b256 = peaks(256)
    # Room between the forward's peak and the backward's at 512 (the last, and only, micro-batch's
    # backward runs out of memory), and enough for a micro-batch of 256 to run whole.
    room = max(b256, f512) + (b512 - max(b256, f512)) // 3
    assert f512 < room < b512, (f512, b256, b512)
    seen = {"backward_ooms": 0, "held_after": []}

    def watch(ht):
        original = stepping.StepLoop.backward

        def backward(self, loss, tokens):
            original(self, loss, tokens)
            mb = self.state.mb
            if mb is not None and mb.failed and mb.failed.startswith("backward"):
                seen["backward_ooms"] += 1
                torch.cuda.synchronize()
                seen["held_after"].append(torch.cuda.memory_allocated())
        stepping.StepLoop.backward = backward
        # Sized from what the driver says is free now: a ballast leaves `room` for the steps.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        seen["ballast"] = torch.empty(max(0, free - room), dtype=torch.uint8, device="cuda")
        seen["ballast_bytes"] = seen["ballast"].numel()
        seen["restore"] = lambda: setattr(stepping.StepLoop, "backward", original)

    oom = job(2, micro=512, width=OOM_WIDTH, rows=OOM_ROWS, watch=watch)
    seen.pop("restore")()
    ballast = seen.pop("ballast")
    del ballast
    torch.cuda.empty_cache()
    clean = job(2, micro=256, width=OOM_WIDTH, rows=OOM_ROWS)
    return oom, clean, seen, (f512, b512, b256, room)


def test_a_real_cuda_oom_in_the_last_backward_is_recovered_and_keeps_the_result():
    ((oom, clean, seen, sizes),) = run_ranks(oom_worker, 1, timeout=600)
    print("forward peak 512, backward peak 512, backward peak 256, room:", sizes, "seen:", seen)
    assert seen["backward_ooms"] >= 1, seen           # the OOM struck in the (last) backward
    assert oom["ooms"] >= 1 and oom["plan"].devices[0].micro_batch < 512 and oom["plan"].version >= 1
    # the failed graph was released before anything else allocated: only the ballast, the model
    # and this step's inputs remain (well under the forward's activations)
    f512 = sizes[0]
    assert all(h - seen["ballast_bytes"] < f512 / 2 for h in seen["held_after"]), seen
    assert max((a - b).abs().max().item() for a, b in zip(oom["params"], clean["params"])) <= 1e-4


def resume_worker(rank, world, ckpt):
    first = job(2, micro=128, ckpt=ckpt)       # writes step-2 from CUDA tensors
    resumed = job(4, micro=128, ckpt=ckpt)     # resumes at step 2
    straight = job(4, micro=128)
    return first, resumed, straight


def test_checkpoint_from_cuda_resumes_to_the_same_parameters(tmp_path):
    ((_, resumed, straight),) = run_ranks(resume_worker, 1, str(tmp_path), timeout=600)
    assert max((a - b).abs().max().item() for a, b in zip(resumed["params"], straight["params"])) <= 1e-6
