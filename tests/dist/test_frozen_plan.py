"""A plan changed in place after prepare() (ht.plan is the plan every rank agreed on) is refused
at the next step, in one line, on a real two-rank job."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

pytestmark = pytest.mark.dist


def mutating_worker(rank: int, world: int):
    import hetrain
    from hetrain import Rebalancing, Reporting
    from hetrain.errors import UsageError
    from hetrain.planning.plan import DevicePlan, Plan

    plan = Plan(global_batch=8, devices=(DevicePlan(rank=0, device="cpu0", speed=1.0, share=5, micro_batch=5),
                                         DevicePlan(rank=1, device="cpu1", speed=1.0, share=3, micro_batch=3)))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    ht = hetrain.init(global_batch=8, plan=plan, max_steps=4, precision="fp32", reporting=Reporting(verbose=False),
                      rebalancing=Rebalancing(enabled=False))
    net = torch.nn.Linear(4, 1)
    net, opt, steps = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data)
    done, refused = 0, None
    try:
        for step in steps:
            for mb in step:
                with mb:
                    x, y = mb.batch
                    ht.backward(F.mse_loss(net(x), y))
            ht.step()
            done += 1
            object.__setattr__(ht.plan.devices[1], "share", 4)     # every rank, as a script would
    except UsageError as e:
        refused = str(e)
    ht.close()
    return done, refused


def test_a_plan_changed_in_place_after_prepare_is_refused_at_the_next_step():
    for done, refused in run_ranks(mutating_worker, 2, timeout=120):
        assert done == 1                         # the first step ran; the second is refused before it starts
        assert refused is not None and "\n" not in refused
        assert "was changed in place" in refused and "plans are frozen: make a new one with" in refused


def mismatched_wrapper_worker(rank: int, world: int):
    """The wrapper runs another sharding than the plan was completed for (forced here: 'zero1'
    where the plan's DataParallel() runs 'none'): the build refuses it as hetrain's bug."""
    import hetrain
    from hetrain import Rebalancing, Reporting
    from hetrain.errors import HetrainError
    from hetrain.runtime.sharding import wrap as wrapping

    plain = wrapping.wrap
    wrapping.wrap = lambda *a, strategy, **k: plain(*a, strategy="zero1" if strategy == "none" else strategy, **k)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    ht = hetrain.init(global_batch=8, max_steps=2, precision="fp32", reporting=Reporting(verbose=False),
                      rebalancing=Rebalancing(enabled=False))
    net = torch.nn.Linear(4, 1)
    try:
        ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data, parallel=hetrain.DataParallel(sharding="none"))
    except HetrainError as e:
        return str(e), ht.plan.version
    return None, None


def test_a_wrapper_other_than_the_plan_says_is_refused_as_a_bug():
    for refused, version in run_ranks(mismatched_wrapper_worker, 2, timeout=120):
        assert refused is not None and "\n" not in refused
        assert "wrapped under sharding 'zero1', but the plan in force (v0) was completed for sharding 'none'" in refused
        assert "this is a bug in hetrain" in refused and version == 0
