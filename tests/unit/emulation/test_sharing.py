"""Emulated devices sharing the host's cores (emulation/sharing.py): the rate, the pipeline's
step played out event by event against the same step ticked out, and the ranking's rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetrain.emulation.sharing import SharedHost, cpu_rate, play_step, stretched_step
from hetrain.planning.ranking import ModelState, rank_layouts
from hetrain.planning.options import PlanOptions
from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, StageDevice, evaluate_split, split_pipeline
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


def _split(speeds, *, micro_batches=8, micro=4, schedule="1f1b", sizes=None):
    profile = PipelineProfile(blocks=tuple(BlockCost(seconds=0.01 * (1 + i % 2), param_bytes=1e6, activation_bytes=1e5)
                                           for i in range(4)))
    devices = [StageDevice(name=f"dev{i}", speed=s) for i, s in enumerate(speeds)]
    if sizes is None:
        return split_pipeline(profile, devices, micro_batches=micro_batches, micro_batch_size=micro, schedule=schedule)
    return evaluate_split(profile, devices, sizes, micro_batches=micro_batches, micro_batch_size=micro,
                          schedule=schedule)


def _ticked(replicas, *, cores, dt, **rate):
    """The reference: the same step advanced in ticks of dt (no events), each process a small
    state machine: wait for its input and its sleep, compute its piece's CPU at the tick's rate,
    sleep wall·(1/v − 1). Returns the step's end."""
    procs = []
    for r, split in enumerate(replicas):
        p = len(split.stages)
        for s, st in enumerate(split.stages):
            cpu = st.seconds_per_micro * st.speed
            if split.schedule == "gpipe":
                order = [("F", k) for k in range(split.micro_batches)] + [("B", k) for k in range(split.micro_batches)]
            else:                               # torch's Schedule1F1B: p − s warm-up forwards
                warm = min(split.micro_batches, p - s)
                order, f = [("F", k) for k in range(warm)], warm
                for k in range(split.micro_batches):
                    order.append(("B", k))
                    if f < split.micro_batches:
                        order.append(("F", f))
                        f += 1
            procs.append(dict(r=r, s=s, p=p, v=st.speed, cost={"F": cpu / 3, "B": 2 * cpu / 3}, order=order,
                              at=0, state="idle", left=0.0, until=0.0, began=0.0))
    sent, t = {}, 0.0
    while any(q["at"] < len(q["order"]) or q["state"] != "idle" for q in procs):
        for q in procs:
            if q["state"] == "sleep" and t >= q["until"] - 1e-12:
                sent[(q["r"], q["s"], *q["order"][q["at"]])] = q["until"]
                q["state"], q["at"] = "idle", q["at"] + 1
            if q["state"] == "idle" and q["at"] < len(q["order"]):
                kind, k = q["order"][q["at"]]
                dep = (q["r"], q["s"] - 1, "F", k) if kind == "F" and q["s"] > 0 else (
                    (q["r"], q["s"] + 1, "B", k) if kind == "B" and q["s"] < q["p"] - 1 else None)
                if dep is None or dep in sent:
                    q["state"], q["left"], q["began"] = "compute", q["cost"][kind], t
        running = [q for q in procs if q["state"] == "compute"]
        rate_now = cpu_rate(len(running), cores=cores, **rate)
        for q in running:
            q["left"] -= rate_now * dt
            if q["left"] <= 0:
                spent = t + dt - q["began"]
                q["state"], q["until"] = "sleep", t + dt + spent * (1 / q["v"] - 1)
        t += dt
    return max(sent.values())


@pytest.mark.parametrize("case", [
    dict(speeds=[[1.0, 0.5]], cores=1),
    dict(speeds=[[0.5, 0.5], [0.335, 0.335]], cores=2, micro=[3, 2], micro_batches=7),
    dict(speeds=[[1.0, 0.67]], cores=2, contention=1.3, contention_at=2),
    dict(speeds=[[0.5, 0.4], [0.3, 0.3]], cores=1, schedule="gpipe", micro_batches=4),
    dict(speeds=[[0.9, 0.5, 0.7, 0.6]], cores=2, load=0.5, micro_batches=6),
])
def test_the_played_step_is_the_step_ticked_out(case):
    micro = case.get("micro") or [4] * len(case["speeds"])
    sizes = (1, 1, 1, 1) if len(case["speeds"][0]) == 4 else (2, 2)
    replicas = [_split(sp, micro_batches=case.get("micro_batches", 8), micro=mu, schedule=case.get("schedule", "1f1b"),
                       sizes=sizes) for sp, mu in zip(case["speeds"], micro)]
    rate = {k: case[k] for k in ("load", "contention", "contention_at") if k in case}
    played, _ = play_step(replicas, cores=case["cores"], **rate)
    ticked = _ticked(replicas, cores=case["cores"], dt=2e-5, **rate)
    assert played == pytest.approx(ticked, rel=2e-3)
    alone, stretch = play_step(replicas, cores=None)
    assert stretch == pytest.approx((1.0,) * len(stretch)) and played > alone


def test_a_pipeline_on_enough_cores_is_unchanged_and_sharing_processes_in_lockstep_halves_them():
    split = _split([1.0, 0.5])
    step, stretch = stretched_step([split], cores=2)
    assert step == pytest.approx(split.step_seconds) and stretch == pytest.approx((1.0, 1.0))
    # two one-stage "pipelines" that start every piece together on one core: each piece takes
    # twice its CPU time, and so does each sleep after it: the step doubles, exactly
    one = _split([0.5], sizes=(4,), micro_batches=3)
    step, stretch = stretched_step([one, one], 0.004, cores=1)
    assert step == pytest.approx(2 * one.step_seconds + 0.004) and stretch == pytest.approx((2.0, 2.0))
    # played out alone, a pipeline is never slower than the fill-drain formula it scales
    for speeds in ([1.0, 0.5], [0.5, 1.0], [0.7, 0.7]):
        s = _split(speeds, sizes=(3, 1))
        assert play_step([s], cores=None)[0] <= s.step_seconds * (1 + 1e-12)


P = 5_000_000


def _profiles(speeds):
    return [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.0, per_sample_s=0.01 / s,
                          fixed_bytes=16 * P, activation_bytes_per_sample=1e6) for i, s in enumerate(speeds)]


def _row(ranking, family):
    return next(r for r in ranking.rows if r.family == family)


def test_the_ranking_stretches_emulated_pipelines_on_shared_cores_and_leaves_dp_to_its_own_model():
    profiles = _profiles([0.5, 0.5, 0.335, 0.335])
    state = ModelState(params=P, trainable=P, blocks=4)
    rank = lambda host=None: rank_layouts([replace(p, host=host) for p in profiles], state=state,  # noqa: E731
                                          options=PlanOptions(global_batch=32, grad_bytes=4 * P))
    gpus = rank()                                             # real GPUs: no host cores to share
    shared = rank(SharedHost(cores=2, contention=1.15, contention_at=2))
    roomy = rank(SharedHost(cores=4))                         # a core each, no contention measured
    said = "emulated stages share"
    for family in ("PP", "DP×PP"):
        assert _row(shared, family).samples_per_s < 0.98 * _row(gpus, family).samples_per_s
        assert said in _row(shared, family).detail and said not in _row(gpus, family).detail
        assert _row(roomy, family).samples_per_s == pytest.approx(_row(gpus, family).samples_per_s, rel=1e-12)
    # data parallelism keeps its own play-out (SharedHost.play), nothing added on top
    assert said not in _row(shared, "DP").detail
