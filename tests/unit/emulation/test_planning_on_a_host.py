"""The planner on emulated devices that share one host: the host comes with the profiles
(DeviceProfile.host, emulation/sharing.SharedHost), never with the planner's options."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetrain.emulation.sharing import SharedHost
from hetrain.planning.collectives import FREE_LINK
from hetrain.planning.cost import Assignment, step_cost
from hetrain.planning.planner import PlanOptions, make_plan
from hetrain.planning.profile import DeviceProfile

MIB = 1024**2


def options(batch, **kw):
    return PlanOptions(global_batch=batch, **kw)


def _profile(name, per_sample, overhead=0.0, opt=0.0, memory=None):
    return DeviceProfile(device=name, source="test", overhead_s=overhead, per_sample_s=per_sample,
                         optimizer_s=opt, fixed_bytes=100 * MIB, activation_bytes_per_sample=10 * MIB,
                         memory_bytes=memory)


def on_host(profiles, host):
    return [replace(p, host=host) for p in profiles]


def test_emulated_devices_on_too_few_cores_plan_with_the_stretched_times():
    """Three emulated devices (speeds 1, 0.67, 0.5: each on the CPU that fraction of its time)
    want 2.17 cores of 2: compute stretches, and the split accounts for it."""
    cpu_s = 0.004                                        # CPU seconds per sample on the host
    profiles = [replace(_profile(f"s{s}", cpu_s / s, overhead=0.001 / s), cpu_share=s) for s in (1.0, 0.67, 0.5)]
    quiet = make_plan(profiles, options(96, link=FREE_LINK))
    busy = make_plan(on_host(profiles, SharedHost(cores=2)), options(96, link=FREE_LINK))
    assert quiet.predicted["cpu_stretch"] == 1.0 and 1.0 < busy.predicted["cpu_stretch"] < 1.5
    assert busy.predicted["step_s"] > quiet.predicted["step_s"]

    def under_contention(plan):
        return step_cost([Assignment(profile=p, share=d.share, micro_batch=d.micro_batch)
                          for p, d in zip(profiles, plan.devices)], global_batch=96, grad_bytes=0,
                         link=FREE_LINK, host=SharedHost(cores=2))

    # What it predicts is the cost model's step for its own split, and that split beats the split
    # made as if the devices had the host to themselves.
    assert under_contention(busy).step_s == pytest.approx(busy.predicted["step_s"])
    assert [d.predicted_compute_s for d in busy.devices] == pytest.approx(list(under_contention(busy).compute_s))
    assert busy.predicted["step_s"] <= under_contention(quiet).step_s + 1e-12


def test_the_last_micro_batchs_measured_pacing_and_ddp_costs_are_planned_for():
    """Two devices alike but for what their last micro-batch costs paced (the profile's
    paced_cost): the split leans away from the dearer one, and the predicted step is the cost
    model's with DDP's measured cost on top."""
    plain = replace(_profile("a", 0.01, overhead=0.002), cpu_share=0.5)
    dear = replace(_profile("b", 0.01, overhead=0.002), cpu_share=0.5, paced_cost=1.3)
    o, host = options(64, link=FREE_LINK), SharedHost(cores=2, ddp_cost=1.1)
    plan = make_plan(on_host([plain, dear], host), o)
    assert plan.shares[0] > plan.shares[1]
    again = step_cost([Assignment(profile=p, share=d.share, micro_batch=d.micro_batch)
                       for p, d in zip((plain, dear), plan.devices)], global_batch=64, grad_bytes=0,
                      link=FREE_LINK, host=host)
    assert again.step_s == pytest.approx(plan.predicted["step_s"])
    assert plan.predicted["ddp_cost"] == 1.1
    unpaced = make_plan(on_host([plain, replace(dear, paced_cost=1.0)], SharedHost(cores=2)), o)
    assert unpaced.shares == (32, 32) and unpaced.predicted["step_s"] < plan.predicted["step_s"]


def test_under_a_micro_batch_cap_the_split_with_pacing_costs_is_the_best_one():
    """Capped at 8 samples a micro-batch, the pacing and DDP costs fall on one micro-batch of 8 at
    most, not on the whole share: the planner's split is as fast as the best of every split,
    costed by the cost model."""
    a = replace(_profile("a", 0.01, overhead=0.002, memory=None), cpu_share=0.5)
    b = replace(_profile("b", 0.012, overhead=0.002, memory=None), cpu_share=0.5, paced_cost=1.3)
    o, host = options(64, link=FREE_LINK, micro_batch_cap=8), SharedHost(cores=2, ddp_cost=1.1)
    plan = make_plan(on_host([a, b], host), o)
    best = min(step_cost([Assignment(profile=a, share=s, micro_batch=8), Assignment(profile=b, share=64 - s, micro_batch=8)],
                         global_batch=64, grad_bytes=0, link=FREE_LINK, host=host).step_s
               for s in range(1, 64))
    assert plan.predicted["step_s"] == pytest.approx(best, rel=1e-9)
