"""Shared pieces of the pipeline equivalence tests (tests/dist/test_pipeline.py, test_hybrid.py,
tests/gpu/test_model_parallel_gpu.py): the models and data, one hetrain job through
`ht.prepare(parallel=...)` and the user's loop, and the single-process reference on the same
samples in the same order (the job's sampler, replayed).

Float64 and plain SGD: every difference from the reference is then rounding, far below 1e-9, and
a wrong weighting, a missed tied-weight sum or a norm counted over the wrong parameters is not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nets import Residual
from hetrain import Reporting
from hetrain.emulation import Emulation

LR, SEED = 0.1, 3


def gpt_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def make_case(case: str, n: int):
    """(model, dataset tensors (x, y), loss_fn), the same in every process."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "gpt":        # the demo GPT: its embedding and head share one weight (first and last stage)
        from hetrain.demo.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=4, n_heads=2)).double()
        return model, (torch.randint(0, 32, (n, 8), generator=g), torch.randint(0, 32, (n, 8), generator=g)), gpt_loss
    if case.startswith("stack"):     # "stack" (6 blocks) or "stack2" (2 blocks)
        model = torch.nn.Sequential(*(Residual(6) for _ in range(int(case[5:] or 6)))).double()
        x = torch.randn(n, 6, generator=g, dtype=torch.float64)
        return model, (x, torch.randn(n, 6, generator=g, dtype=torch.float64)), F.mse_loss
    raise ValueError(case)


def reference(case: str, *, n: int, global_batch: int, steps: int, grad_clip: float | None = None):
    """The whole model in one process on each step's global batch (the job's sampler replayed):
    per step the loss, the (clipped) gradients by name and the norm; the parameters at the end."""
    from hetrain.runtime.loop.sampler import GlobalCursorSampler

    model, (x, y), loss_fn = make_case(case, n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = GlobalCursorSampler(n, global_batch, seed=SEED)
    losses, grads, norms = [], [], []
    for _ in range(steps):
        idx = torch.tensor(sampler.next_step().indices)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        # the tied weight once (named_parameters lists it once)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf).item())
        losses.append(loss.item())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "norms": norms,
            "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


def pipeline_plan(layout: str, *, blocks, schedule: str, shares, micro, world: int):
    """A given Plan: `blocks` per stage, replica r's share shares[r] in micro-batches of micro[r]."""
    from hetrain.planning.plan import DevicePlan, Plan

    stages = len(blocks)
    devices = tuple(DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=shares[r // stages],
                               micro_batch=micro[r // stages]) for r in range(world))
    return Plan(global_batch=sum(shares), devices=devices, layout=layout, group=stages, stage_blocks=tuple(blocks),
                schedule=schedule)


def train(case: str, *, n: int, global_batch: int, steps: int, parallel, grad_clip: float | None = None,
          emulate: str | None = None, shrink_rank: int | None = None, precision: str = "auto",
          emulate_sample_s: float | None = None, **pipeline):
    """One hetrain job over `steps` steps of `case`; returns what each check needs, with the errors
    against the reference. Every rank calls it (the process group is the caller's).
    `shrink_rank`: after the first step, cap that rank's emulated memory at what it holds already,
    so the next step runs out of memory at any micro-batch size (the error is returned).
    `pipeline`: stages=, micro_batches=, schedule= of hetrain.Pipeline, for parallel='pp'/'dp-pp'."""
    import hetrain
    from hetrain.errors import HetrainError

    ref = reference(case, n=n, global_batch=global_batch, steps=steps, grad_clip=grad_clip)
    ht = hetrain.init(global_batch=global_batch, max_steps=steps, seed=SEED, grad_clip=grad_clip,
                      emulation=Emulation(cluster=emulate, sample_s=emulate_sample_s),
                      reporting=Reporting(verbose=False), precision=precision)
    model, (x, y), loss_fn = make_case(case, n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grads": []}
    if pipeline and isinstance(parallel, str):
        parallel = hetrain.Pipeline(**{"stages": "auto" if parallel == "dp-pp" else None, **pipeline})
    with ht:
        model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y), parallel=parallel,
                                         loss_fn=loss_fn)
        names = {id(p): k for k, p in model.module.named_parameters()}
        # the gradients the update used: after weighting, the tied-weight sum, replicas and clipping
        opt.register_step_pre_hook(lambda o, args, kwargs: out["grads"].append(
            {names[id(p)]: p.grad.to("cpu", copy=True) for g in o.param_groups for p in g["params"]}))
        pipe = ht.job.layout.pipe
        try:
            for step in batches:
                for mb in step:
                    with mb:
                        ht.backward(ht.loss(mb))
                ht.step()
                out["losses"].append(step.loss)
                if shrink_rank == ht.rank:
                    ht.emulated.meter.cap = ht.emulated.meter.fixed + 1
        except HetrainError as e:
            out["error"] = str(e)
        mine = {names[id(p)]: p.detach().cpu() for p in model.parameters()}
        out.update(
            names=sorted(mine), device=ht.device.type, backend=ht.ctx.backend, on_device=all(p.device == ht.device for p in model.parameters()), sizes=pipe.split.sizes, stage=pipe.stage_index, replica=pipe.replica,
            share=ht.plan.devices[ht.rank].share, micro=ht.plan.devices[ht.rank].micro_batch,
            predicted=dict(ht.plan.predicted), split_step_s=pipe.split.step_seconds,
            peak_in_flight=pipe.peak_in_flight, planned_in_flight=pipe.split.stages[pipe.stage_index].in_flight,
            bubble=pipe.split.bubble_fraction, micro_batches=pipe.split.micro_batches,
            activation_bytes=pipe.peak_activation_bytes,
            compute_s=pipe.compute_s + pipe.stage.compute_s if pipe.stage is not None else pipe.compute_s,
            busy_s=pipe.busy_s + pipe.stage.busy_s if pipe.stage is not None else pipe.busy_s,
            speed=ht.emulated.spec.speed if emulate else 1.0,
            # on the controlled clock: the split's stages at speed 1, and a micro-batch's clocked seconds here
            stage_s_at_speed_1=[st.seconds_per_micro * st.speed for st in pipe.split.stages],
            clocked_micro_s=pipe.given_micro_s(pipe.split.micro_batch_size),
            # the throttle's books: the compute it timed (the stage's pieces, the optimizer step)
            # and the sleeps, slept or still owed
            throttled_s=ht.emulated.throttle.cpu_seconds if emulate else 0.0,
            slept_s=ht.emulated.throttle.slept_seconds + ht.emulated.throttle.owed if emulate else 0.0,
            loss_error=max((abs(a - b) for a, b in zip(out["losses"], ref["losses"])), default=math.inf),
            grad_error=max((max((g[k] - r[k]).abs().max().item() for k in g) for g, r in zip(out["grads"], ref["grads"])),
                           default=math.inf),
            # after a step that failed, the parameters are one step behind the reference's
            param_error=max((mine[k] - ref["params"][k]).abs().max().item() for k in mine) if "error" not in out else None,
            clipped=grad_clip is not None and all(nm > grad_clip for nm in ref["norms"]))
        out["steps"] = len(out.pop("grads"))
    return out


def join_group() -> None:
    """The ranks' process group, made once by the test (gloo, from the harness's torchrun
    environment): hetrain.init uses it as it is, so one process runs several jobs in turn."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
