"""sharding='capacity-full': parameters, gradients and optimizer state split in proportion to each
device's free memory (runtime/sharding/capacity_full.py), composed with uneven per-rank batches.

References are independent of the code under test: a single process computing each step's whole
batch with the same optimizer (float64, so AdamW's amplification of rounding cannot hide a
mistake), the emulated caps for the split, an uninterrupted run for a resume.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks
from nets import BlockNet, Residual
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Checkpoints, Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N, D = 192, 8
EMULATE3 = "a100-80g@64MiB,rtx3090:1.0@24MiB,rtx3090:1.0@8MiB"   # the plans are given: at speed 1 no device sleeps


def Deep(h: int = 16, n: int = 3) -> nn.Module:
    """An input layer, `n` residual blocks (the units), a head."""
    return BlockNet(D, h, n, block=Residual)


def make_plan(shares, micros) -> Plan:
    return Plan(global_batch=sum(shares), devices=tuple(
        DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=s, micro_batch=m)
        for r, (s, m) in enumerate(zip(shares, micros))))


def data(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=g, dtype=dtype), torch.randn(N, 1, generator=g, dtype=dtype)


def net(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return Deep(**kw).to(dtype)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def job(plan, steps, *, emulate, dtype=torch.float64, sharding="capacity-full", record=True, net_kw=None, **extra):
    import hetrain

    x, y = data(dtype)
    model = net(dtype, **(net_kw or {}))
    ht = hetrain.init(global_batch=plan.global_batch, plan=plan, max_steps=steps,
                      precision="fp32", emulation=Emulation(cluster=emulate), reporting=Reporting(verbose=False),
                      rebalancing=Rebalancing(enabled=False), timeout_s=60, **extra)
    try:
        return train(ht, model, x, y, sharding, record)
    except hetrain.HetrainError:
        ht.close()          # a refused job leaves none behind: the next one joins the same process group
        raise


def train(ht, model, x, y, sharding, record) -> dict:
    import hetrain

    model, opt, batches = ht.prepare(model, adamw(model.parameters()), torch.utils.data.TensorDataset(x, y),
                                     parallel=hetrain.DataParallel(sharding=sharding))
    out = {"indices": [], "grads": [], "micro_counts": [], "strategy": sharding}
    for step in batches:
        n = 0
        for mb in step:
            with mb:
                bx, by = mb.batch
                ht.backward(F.mse_loss(model(bx), by))
                n += 1
        if record and hasattr(opt, "sharding"):
            out["grads"].append(opt.sharding.full_gradients())      # a collective: every rank
        out["micro_counts"].append(n)
        out["indices"].append(list(step.indices))
        ht.step()
    if hasattr(opt, "sharding"):
        sharding = opt.sharding
        out["params"] = sharding.full_parameters()
        out["fractions"] = sharding.fractions
        out["owned"] = sum(s.shard.numel() for s in sharding.segments())
        out["bounds"] = [s.bounds for s in sharding.segments()]
        out["state_elements"] = sum(t.numel() for t in opt.held_tensors())
    else:
        out["params"] = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    out["memory"] = ht.summary()["memory"]
    ht.close()
    return out


def reference(step_indices, dtype=torch.float64, clip=None):
    x, y = data(dtype)
    model = net(dtype)
    opt = adamw(model.parameters())
    grads = []
    for idx in step_indices:
        idx = torch.tensor(idx)
        F.mse_loss(model(x[idx]), y[idx]).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def step_indices(records, steps):
    out = [sum((r["indices"][s] for r in records), []) for s in range(steps)]
    for idx in out:
        assert len(idx) == len(set(idx))
    return out


# -- the jobs: a 2-rank process group, then a 3-rank one ------------------------------------------------
THREE = ((7, 13, 12), (3, 13, 5))      # rank 0: 3 micro-batches, rank 2: 3, rank 1: one
STEPS, CUT = 6, 3                      # the checkpointed job: saved every CUT steps of STEPS, resumed at CUT


def three_worker(rank, world, root):
    """The exact 3-rank job, then the 2-rank job's checkpoint resumed on 3 ranks."""
    from pipeline_runs import join_group

    join_group()
    return {"exact": job(make_plan(*THREE), 3, emulate=EMULATE3, grad_clip=0.5),
            "resumed": job(ckpt_plan(3), STEPS, emulate=EMULATE3, record=False,
                           checkpoints=Checkpoints(dir=f"{root}/ck3", every=CUT))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job of this file: {"pair": [each rank's], "three": [each rank's]}; the pair's first job
    saves the checkpoint the three's second resumes."""
    root = str(tmp_path_factory.mktemp("capacity"))
    pair = run_ranks(pair_worker, 2, root, timeout=300)
    return {"pair": pair, "three": run_ranks(three_worker, 3, root, timeout=300)}


@pytest.fixture(scope="module")
def three(runs):
    return make_plan(*THREE), [r["exact"] for r in runs["three"]]


def test_capacity_full_equals_one_device_big_batch_float64_adamw(three):
    plan, records = three
    assert [r["micro_counts"][0] for r in records] == [3, 1, 3]
    idx = step_indices(records, 3)
    ref_grads, ref_params = reference(idx, clip=0.5)
    for r in records:
        for s in range(3):
            assert max_diff(r["grads"][s], ref_grads[s]) <= 1e-12, s
        assert max_diff(r["params"], ref_params) <= 1e-12


def test_each_rank_owns_in_proportion_to_its_emulated_memory(three):
    """The caps are 64 : 24 : 8 MiB and the model a few KiB: each rank's owned elements (of every
    unit's flat buffer) and its optimizer state follow the caps, and every element is owned once."""
    _, records = three
    total = sum(p.numel() for p in net().parameters())
    assert sum(r["owned"] for r in records) == total
    caps = (64, 24, 8)
    for r, cap in zip(records, caps):
        assert r["owned"] / total == pytest.approx(cap / sum(caps), abs=0.02)
        assert r["state_elements"] == 2 * r["owned"]            # AdamW: exp_avg + exp_avg_sq of its slices
    assert records[0]["fractions"] == records[1]["fractions"] == records[2]["fractions"]
    for bounds in records[0]["bounds"]:                          # contiguous slices, in rank order
        assert bounds[0] == 0 and list(bounds) == sorted(bounds)
    # what the emulated meter counts: the owned slices (float64 parameters, gradients, 2 moments) and
    # what is gathered at once: a rank with one micro-batch the root (input layer + head) and two
    # blocks, each with its flat gradient; a rank that accumulates the whole model and its gradient
    root, block = (D * 16 + 16) + (16 + 1), 16 * 16 + 16
    for rank, (r, accumulates) in enumerate(zip(records, (True, False, True))):
        gathered = 2 * total * 8 if accumulates else 2 * (root + 2 * block) * 8
        assert records[0]["memory"][rank]["held_state"] == r["owned"] * 8 * 4 + gathered


# -- checkpoints at another world size --------------------------------------------------------------
def ckpt_plan(world):
    shares = {1: (16,), 2: (10, 6), 3: (6, 5, 5)}[world]
    return make_plan(shares, [max(1, s // 2) if r == 0 else s for r, s in enumerate(shares)])


def pair_worker(rank, world, root):
    """The 2-rank jobs in one process group: the checkpointed one, the big model under capacity-full,
    the refusal and FSDP2's out-of-memory; then rank 0 alone resumes the checkpoint on one device."""
    import torch.distributed as dist

    from hetrain.runtime.ranks.dist import init_distributed

    init_distributed(timeout_s=60, use_cuda=False)
    ref = job(ckpt_plan(2), STEPS, emulate="a100-80g@64MiB,rtx3090:1.0@24MiB", record=False,
              checkpoints=Checkpoints(dir=f"{root}/ck", every=CUT))
    if rank == 0:                    # as if the job had died after saving step CUT
        shutil.rmtree(f"{root}/ck/step-{STEPS:08d}")
        shutil.copytree(f"{root}/ck", f"{root}/ck3")
    dist.barrier()
    out = {"reference": ref, "full": fit_job("capacity-full"), "refused": refused()}
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "reset_iter_state"):   # FSDP2's OOM told in-loop (torch 2.13+); before, it ends the attempt
        out["fsdp"] = fit_job("fsdp")
    dist.destroy_process_group()
    if rank == 0:                    # rank 0 alone resumes it on one device (unsharded)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out["alone"] = job(ckpt_plan(1), STEPS, emulate="a100-80g@64MiB", record=False,
                           checkpoints=Checkpoints(dir=f"{root}/ck", every=CUT))
        dist.destroy_process_group()
    return out


def test_checkpoint_resumes_at_another_world_size(runs):
    saved = runs["pair"]
    ref = saved[0]["reference"]["params"]
    assert saved[1]["reference"]["params"].keys() == ref.keys()
    alone = saved[0]["alone"]
    assert alone["strategy"] == "capacity-full" and len(alone["indices"]) == STEPS - CUT
    assert max_diff(alone["params"], ref) <= 1e-10              # 2 ranks -> 1, float64
    resumed = [r["resumed"] for r in runs["three"]]
    for r in resumed:
        assert len(r["indices"]) == STEPS - CUT
        assert max_diff(r["params"], ref) <= 1e-10              # 2 ranks -> 3
    _, straight = reference(step_indices([saved[0]["reference"], saved[1]["reference"]], STEPS))
    assert max_diff(ref, straight) <= 1e-10


# -- memory: more than even FSDP2, and a clear refusal when nothing fits -------------------------------
BIG = {"h": 128, "n": 8}                          # 134k parameters: 2.1 MB of fp32 AdamW state
PAIR = "a100-80g@8MiB,rtx3090:1.0@1MiB"


def fit_job(sharding):
    import hetrain

    plan = make_plan((6, 2), (6, 2))
    try:
        out = job(plan, 2, emulate=PAIR, dtype=torch.float32, sharding=sharding, record=False, net_kw=BIG)
        return {"trained": True, "memory": out["memory"]}
    except hetrain.HetrainError as e:
        return {"trained": False, "what": e.what}


def test_a_model_fsdp2_cannot_fit_on_the_small_card_trains_fully_capacity_sharded(runs):
    """2.1 MB of state: half of it (FSDP2) is more than the 1 MiB card's usable 0.9 MiB; in
    proportion to free memory (8 : 1) it holds about an eighth."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, "reset_iter_state"):   # FSDP2's OOM told in-loop (torch 2.13+); before, it ends the attempt
        fsdp = [r["fsdp"] for r in runs["pair"]]
        assert [r["trained"] for r in fsdp] == [False, False], fsdp
        assert "out of memory" in fsdp[0]["what"]
    full = [r["full"] for r in runs["pair"]]
    assert [r["trained"] for r in full] == [True, True], full
    small = full[0]["memory"][1]     # the 3090 holds its slices and the units in flight, within its cap
    assert small["held_state"] < small["planned"] <= 0.9 * small["cap"]
    assert small["held_state"] < 0.5 * 2.1e6                    # less than FSDP2's even half of the state


def refused():
    import hetrain

    try:
        job(make_plan((6, 2), (6, 2)), 1, emulate="a100-80g@1MiB,rtx3090:1.0@1MiB", dtype=torch.float32,
            record=False, net_kw=BIG)
    except hetrain.UsageError as e:
        return e.what
    return None


def test_too_little_memory_even_fully_sharded_is_refused_on_every_rank_with_the_bytes_missing(runs):
    said = [r["refused"] for r in runs["pair"]]
    assert said[0] == said[1] and said[0] is not None
    assert "does not fit even fully sharded" in said[0]
    for r in (0, 1):
        assert f"rank {r}: its share" in said[0] and "missing" in said[0]
    import re

    missing = [int(m.replace(",", "")) for m in re.findall(r"\(([\d,]+) B\)", said[0])]
    assert len(missing) == 2 and all(m > 0 for m in missing)
