"""Emulated devices sharing the host's cores (planning/core_sharing.py): the rate, each process's
stretch against a brute-force enumeration, the pipeline's fixed point, and the ranking's rows."""

from __future__ import annotations

import itertools
import random

import pytest

from hetrain.planning.core_sharing import computing_stretch, cpu_rate, stretched_step
from hetrain.planning.layouts import ModelState, rank_layouts
from hetrain.planning.options import PlanOptions
from hetrain.planning.pipeline_split import BlockCost, PipelineProfile, StageDevice, split_pipeline
from hetrain.planning.profile import DeviceProfile


def test_the_rate_shares_cores_and_adds_the_measured_contention():
    assert cpu_rate(1, cores=2) == 1.0
    assert cpu_rate(2, cores=2) == 1.0                       # one core each, no contention measured
    assert cpu_rate(4, cores=2) == pytest.approx(0.5)        # processor sharing
    assert cpu_rate(1, cores=2, load=1.0) == 1.0
    assert cpu_rate(2, cores=2, load=2.0) == pytest.approx(0.5)
    assert cpu_rate(2, cores=2, contention=1.2, contention_at=2) == pytest.approx(1 / 1.2)
    # measured with 3 at once; 2 at once pay half of it
    assert cpu_rate(2, cores=4, contention=1.2, contention_at=3) == pytest.approx(1 / 1.1)


def _enumerated(duty, **rate):
    """E[1/rate] for each process by summing over every subset of the others (the reference)."""
    out = []
    for p in range(len(duty)):
        others = [q for q in range(len(duty)) if q != p]
        total = 0.0
        for on in itertools.product((False, True), repeat=len(others)):
            prob = 1.0
            for q, busy in zip(others, on):
                prob *= duty[q] if busy else 1 - duty[q]
            total += prob / cpu_rate(1 + sum(on), **rate)
        out.append(total)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_each_stretch_is_the_expectation_over_the_others(seed):
    rng = random.Random(seed)
    duty = [rng.random() for _ in range(rng.randint(1, 6))]
    rate = dict(cores=rng.choice([1, 2, 3]), load=rng.choice([0.0, 0.5]), contention=1 + rng.random() / 2,
                contention_at=rng.choice([1, 2, 3]))
    assert computing_stretch(duty, **rate) == pytest.approx(_enumerated(duty, **rate), rel=1e-12)


def test_always_busy_processes_divide_the_cores_and_idle_ones_cost_nothing():
    assert computing_stretch([1.0] * 4, cores=2) == pytest.approx((2.0,) * 4)
    assert computing_stretch([1.0, 0.0, 0.0], cores=1) == pytest.approx((1.0, 2.0, 2.0))


def _split(speeds, *, micro_batches=8, micro=4):
    profile = PipelineProfile(blocks=(BlockCost(seconds=0.01, param_bytes=1e6, activation_bytes=1e5),) * 4)
    devices = [StageDevice(name=f"dev{i}", speed=s) for i, s in enumerate(speeds)]
    return split_pipeline(profile, devices, micro_batches=micro_batches, micro_batch_size=micro)


def test_a_pipeline_on_enough_cores_is_unchanged_and_on_one_core_is_a_fixed_point():
    split = _split([1.0, 0.5])
    step, stretch = stretched_step([split], cores=2)
    assert step == pytest.approx(split.step_seconds) and stretch == (1.0, 1.0)

    sync = 0.004
    step, stretch = stretched_step([split, split], sync, cores=1, contention=1.1, contention_at=2)
    assert step > split.step_seconds + sync and min(stretch) > 1.0
    # self-consistent: the stretch is the one the duties at that step give, and the step is that stretch's
    stages = [s for sp in (split, split) for s in sp.stages]
    duty = [split.micro_batches * s.seconds_per_micro * k * s.speed / step for s, k in zip(stages, stretch)]
    assert stretch == pytest.approx(computing_stretch(duty, cores=1, contention=1.1, contention_at=2), rel=1e-4)
    t = [s.seconds_per_micro * k for s, k in zip(split.stages, stretch[:2])]
    assert step == pytest.approx(sum(t) + (split.micro_batches - 1) * max(t) + sync, rel=1e-9)


P = 5_000_000


def _profiles(speeds):
    return [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.0, per_sample_s=0.01 / s,
                          fixed_bytes=16 * P, activation_bytes_per_sample=1e6) for i, s in enumerate(speeds)]


def _row(ranking, family):
    return next(r for r in ranking.rows if r.family == family)


def test_the_ranking_stretches_emulated_pipelines_on_shared_cores_and_leaves_dp_to_its_own_model():
    profiles = _profiles([0.5, 0.5, 0.335, 0.335])
    state = ModelState(params=P, trainable=P, blocks=4)
    rank = lambda **o: rank_layouts(profiles, state=state,                         # noqa: E731
                                    options=PlanOptions(global_batch=32, grad_bytes=4 * P, **o))
    gpus = rank()                                             # real GPUs: no host cores to share
    shared = rank(host_cores=2, contention=1.15, contention_at=2)
    roomy = rank(host_cores=4)                                # a core each, no contention measured
    said = "emulated stages share"
    for family in ("PP", "DP×PP"):
        assert _row(shared, family).samples_per_s < 0.98 * _row(gpus, family).samples_per_s
        assert said in _row(shared, family).detail and said not in _row(gpus, family).detail
        assert _row(roomy, family).samples_per_s == pytest.approx(_row(gpus, family).samples_per_s, rel=1e-12)
    # data parallelism keeps its own cost model (cost.shared_cpu_finish), nothing added on top
    assert said not in _row(shared, "DP").detail
