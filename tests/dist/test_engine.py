"""The runtime around the math: memory-capped micro-batches, the emulated OOM, misuse of the
verbs. (Every multi-process test also checks each rank's exit code: a gloo abort at exit fails it.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Memory, Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist


def tiny_gpt_job(emulate: str, global_batch: int, steps: int, **config):
    import hetrain
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes

    ht = hetrain.init(global_batch=global_batch, max_steps=steps, emulation=Emulation(cluster=emulate),
                      reporting=Reporting(verbose=False), **config)
    model = GPT(GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = ByteWindows(pydoc_bytes()[:200_000], 32)
    model, opt, batches = ht.prepare(model, opt, data)
    losses, counts = [], []
    for step in batches:
        n = 0
        for mb in step:
            with mb:
                x, y = mb.batch
                with ht.autocast():
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                ht.backward(loss)
                n += 1
        ht.step()
        losses.append(step.loss)
        counts.append(n)
    summary = ht.summary()
    plan = ht.plan
    ht.close()
    return {"plan": plan, "losses": losses, "counts": counts, "summary": summary}


def capped_worker(rank, world):
    return tiny_gpt_job("a100-80g,rtx3090@3MiB", 96, 4, rebalancing=Rebalancing(enabled=False))


def pair_worker(rank, world):
    """The two-rank cases in one process group: the capped job, then the cluster of the wrong size."""
    from pipeline_runs import join_group

    join_group()
    return {"capped": capped_worker(rank, world), "wrong world": wrong_world_worker(rank, world)}


def alone_worker(rank, world):
    """The one-rank cases in one process group: the emulated OOM, then the verbs misused."""
    from pipeline_runs import join_group

    join_group()
    return {"oom": oom_worker(rank, world), "misuse": misuse_worker(rank, world)}


@pytest.fixture(scope="module")
def runs():
    """{case: [each rank's result]}, of both worlds."""
    out = {}
    for worker, world in ((pair_worker, 2), (alone_worker, 1)):
        results = run_ranks(worker, world, timeout=300)
        out.update({case: [r[case] for r in results] for case in results[0]})
    return out


def test_memory_cap_splits_the_share_into_micro_batches_and_training_runs(runs):
    r0, r1 = runs["capped"]
    plan = r0["plan"]
    small = plan.devices[1]
    assert plan == r1["plan"]                                   # every rank runs the same plan
    assert small.max_micro_batch < small.share                  # the 3 MiB device cannot take its share
    assert small.n_micro > 1 and plan.devices[0].n_micro == 1   # at once: it runs several micro-batches
    assert "3.0 MiB memory" in small.reasons[1]
    assert r1["counts"] == [small.n_micro] * 4
    assert r0["losses"] == r1["losses"] and r0["losses"][-1] < r0["losses"][0]
    peak = r0["summary"]["ranks"][1]["peak_bytes"]
    assert 0 < peak <= 3 * 1024**2                               # stayed under its cap


def oom_worker(rank, world):
    from hetrain.planning.plan import DevicePlan, Plan

    plan = Plan(global_batch=16, devices=(DevicePlan(rank=0, device="t4", speed=1, share=16, micro_batch=16),))
    try:
        tiny_gpt_job("t4@2MiB", 16, 1, plan=plan, memory=Memory(oom_recovery=False))
    except torch.OutOfMemoryError as e:
        message = str(e)
    else:
        message = "no OOM"
    recovered = tiny_gpt_job("t4@2MiB", 16, 1, plan=plan)     # the same with recovery on
    return message, recovered["plan"], recovered["counts"]


def test_emulated_memory_cap_raises_the_cuda_oom_type(runs):
    ((message, plan, counts),) = runs["oom"]
    assert "out of memory (emulated)" in message and "cap 2.0 MiB" in message
    # with recovery, the micro-batch halves until it fits, and the new size is in the plan
    assert plan.version >= 1 and plan.devices[0].micro_batch < 16 and counts[0] == plan.devices[0].n_micro


def misuse_worker(rank, world):
    import hetrain
    from hetrain.errors import UsageError

    ht = hetrain.init(global_batch=8, max_steps=2, reporting=Reporting(verbose=False))
    model = torch.nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    errors = []
    try:
        ht.backward(model(torch.randn(2, 3)).sum())
    except UsageError as e:
        errors.append(("backward outside", e.what))
    it = iter(batches)
    step = next(it)
    try:
        ht.step()
    except UsageError as e:
        errors.append(("step early", e.what))
    try:
        for mb in step:
            pass        # forgot ht.backward(loss)
    except UsageError as e:
        errors.append(("no backward", e.what))
    try:
        for mb in step:
            pass
    except UsageError as e:
        errors.append(("twice", e.what))
    try:
        ht.prepare(model, opt, data)
    except UsageError as e:
        errors.append(("prepare twice", e.what))
    ht.close()
    return errors


def test_misuse_of_the_verbs_is_explained(runs):
    (errors,) = runs["misuse"]
    kinds = dict(errors)
    assert "outside a micro-batch" in kinds["backward outside"]
    assert "before the step's micro-batches" in kinds["step early"]
    assert "prepare() was already called" in kinds["prepare twice"]
    assert "without ht.backward(loss)" in kinds["no backward"]
    assert "iterated once" in kinds["twice"]


def wrong_world_worker(rank, world):
    import hetrain
    from hetrain.errors import UsageError

    try:
        hetrain.init(global_batch=8, emulation=Emulation(cluster="a100-80g,rtx3090,t4"))
    except UsageError as e:
        return e.what + " | " + e.fix
    return "accepted"


def test_emulated_cluster_must_match_the_process_count(runs):
    a, b = runs["wrong world"]
    assert "names 3 device(s), but this node runs 2 process(es)" in a and "hetrain run --emulate" in a
