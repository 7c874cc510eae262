"""The fast DP×PP search (replica kinds, a bound on each candidate, shares solved only when needed)
chooses what evaluating every candidate in full chooses: the oracle below evaluates each replica
of each composition on its own, as split_hybrid did before it was made fast."""

from __future__ import annotations

import math

import pytest

from hetrain.errors import UsageError
from hetrain.planning.collectives import FREE_LINK, Link, allreduce_seconds
from hetrain.planning.parallelism import compare_parallelism, split_hybrid
from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, StageDevice, evaluate_split, split_pipeline
from hetrain.planning.shares import proportional_shares

from pipeline_cases import compositions, devices, profile

GIB = 1024**3


def brute_force(prof, devs, *, stages, global_batch, micro_batches, link=None, schedule="1f1b"):
    """(sizes, shares, step seconds) of the best common split, every replica and composition in
    full; None when none fits; raises UsageError for the first composition whose shares leave a
    replica fewer than m samples (as split_hybrid does)."""
    groups = [devs[r * stages:(r + 1) * stages] for r in range(len(devs) // stages)]
    kw = dict(micro_batches=micro_batches, link=link, schedule=schedule)
    best, best_rate = None, None
    for sizes in compositions(prof.n_blocks, stages):
        speeds = [1.0 / max(evaluate_split(prof, g, sizes, micro_batch_size=1, **kw).bottleneck.seconds_per_micro,
                            1e-12) for g in groups]
        shares = proportional_shares(global_batch, speeds)
        if min(shares) < micro_batches:
            raise UsageError(f"replica shares {list(shares)}", "")
        reps = [evaluate_split(prof, g, sizes, **{**kw, **cut(b, micro_batches, stages, schedule)})
                for g, b in zip(groups, shares)]
        step = max(r.step_seconds for r in reps)
        rate = global_batch / max(step, 1e-12)
        if all(r.fits for r in reps) and (best_rate is None or rate > best_rate * (1 + 1e-9)):
            best, best_rate = (tuple(sizes), tuple(shares), step, reps[0]), rate
    return best


def cut(share, m, stages, schedule):
    """How the runtime runs a replica's share (planning/plan.DevicePlan): micro-batches of
    µ = ⌈share/m⌉ rows, ⌈share/µ⌉ of them (each padded to µ); 1F1B wants one per stage at least,
    else µ = ⌊share/stages⌋."""
    mu = math.ceil(share / m)
    if schedule == "1f1b" and math.ceil(share / mu) < stages:
        mu = share // stages
    return {"micro_batch_size": mu, "micro_batches": math.ceil(share / mu)}


def _mixed(*kinds):
    """Devices from (speed, memory GiB or None) pairs, in rank order."""
    return [StageDevice(name=f"d{i}", speed=s, memory_bytes=None if m is None else m * GIB)
            for i, (s, m) in enumerate(kinds)]


A, R, V, T = (1.0, 80), (0.6, 24), (0.45, 32), (0.25, 16)     # a100-, 3090-, v100-, t4-like
CLUSTERS = {
    # replicas differ (mixed inside a replica, and between replicas), some repeat
    "mixed-nodes": (profile(12, params=2e8, act=3e7), _mixed(A, A, R, R, A, R, A, R, V, V, T, T), 96, None),
    # memory decides: the small cards cannot hold big stages, so the fits bound matters
    "memory-bound": (profile(8, params=GIB, act=2e8), _mixed(A, T, A, T, R, R, A, A), 64, None),
    # a first and a last part, stage-to-stage sends with latency, uneven blocks
    "parts-and-link": (PipelineProfile(blocks=tuple(BlockCost(seconds=1e-3 * (1 + i % 3), activation_bytes=1e8,
                                                              param_bytes=1e8) for i in range(10)),
                                       first=BlockCost(seconds=2e-3, activation_bytes=5e7, param_bytes=3e8),
                                       last=BlockCost(seconds=1e-3, activation_bytes=5e7, param_bytes=3e8),
                                       boundary_bytes=2e6),
                       _mixed(A, R, (0.6, None), A, V, V, A, R), 80, Link(bandwidth_gbs=3.0, latency_s=2e-5)),
    # a replica too slow for m samples of the batch: the search raises where the oracle does
    "slow-replica": (profile(6), devices(1.0, 1.0, 1.0, 1.0, 0.1, 0.1), 48, None),
    # equal replicas: one kind
    "one-kind": (profile(6), devices(1.0, 0.5, 1.0, 0.5, 1.0, 0.5), 48, None),
    # blocks as a stage runs them (runtime/layouts/pipeline/probe.py): x1.3 a row, 2 ms a block
    "stage-costs": (PipelineProfile(blocks=tuple(BlockCost(seconds=1e-3 * (1 + i % 2), activation_bytes=1e6,
                                                           param_bytes=4e6) for i in range(8)),
                                    stage_factor=1.3, block_s=2e-3),
                    devices(1.0, 0.5, 1.0, 0.5, 0.7, 0.7), 48, None),
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_split_hybrid_matches_the_brute_force_search(name):
    prof, devs, batch, link = CLUSTERS[name]
    w = len(devs)
    checked = 0
    for stages in range(2, min(w, prof.n_blocks) + 1):
        if w % stages or w == stages:
            continue
        m = max(4, stages)
        try:
            ref = brute_force(prof, devs, stages=stages, global_batch=batch, micro_batches=m, link=link)
        except UsageError as e:
            with pytest.raises(UsageError, match="replica shares") as got:
                split_hybrid(prof, devs, stages=stages, global_batch=batch, micro_batches=m, link=link)
            assert got.value.what.startswith(e.what)
            continue
        if ref is None:
            with pytest.raises(UsageError, match=f"DP×PP {w // stages}×{stages}"):
                split_hybrid(prof, devs, stages=stages, global_batch=batch, micro_batches=m, link=link)
            continue
        h = split_hybrid(prof, devs, stages=stages, global_batch=batch, micro_batches=m, link=link)
        assert (h.sizes, h.shares, h.step_seconds) == ref[:3], (name, stages)
        assert [st.device for r in h.replicas for st in r.stages] == [d.name for d in devs]   # each its own
        checked += 1
    assert checked, "no layout of this cluster fits: the case checks nothing"


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_compare_parallelism_picks_the_brute_force_layout(name):
    prof, devs, batch, link = CLUSTERS[name]
    w = len(devs)
    got = compare_parallelism(prof, devs, global_batch=batch, link=link, micro_batches=4)
    free = link or FREE_LINK
    rates = {}
    for c in got.candidates:
        if c.kind == "dp":
            rates[c.name] = (c.samples_per_s if c.fits else None, (), c.shares)
            continue
        m = max(4, c.stages)
        try:
            if c.kind == "pp":
                one = split_pipeline(prof, devs, link=link, **cut(batch, m, c.stages, "1f1b"))
                ref = (one.sizes, (batch,), one.step_seconds, one)
            else:
                ref = brute_force(prof, devs, stages=c.stages, global_batch=batch, micro_batches=m, link=link)
        except UsageError:
            ref = None
        if ref is None:
            rates[c.name] = (None, (), ())
            continue
        sync = allreduce_seconds(w // c.stages, max(st.param_bytes for st in ref[3].stages), free)
        rates[c.name] = (batch / max(ref[2] + sync, 1e-12), ref[0], ref[1])
    fitting = {k: v for k, v in rates.items() if v[0] is not None}
    fastest = max(v[0] for v in fitting.values())
    order = {c.name: ({"dp": 0, "pp": 1, "dp×pp": 2}[c.kind], c.stages) for c in got.candidates}
    want = min((k for k, v in fitting.items() if v[0] >= fastest * 0.95), key=lambda k: (*order[k], -fitting[k][0]))
    assert got.choice.name == want
    assert (got.choice.sizes, got.choice.shares) == fitting[want][1:]
    assert got.choice.samples_per_s == pytest.approx(fitting[want][0], rel=1e-12)
    for c in got.candidates:      # every layout weighed as the oracle weighs it
        assert c.fits == (rates[c.name][0] is not None), c.name
        if c.fits and c.kind != "dp":
            assert (c.sizes, c.shares) == rates[c.name][1:], c.name


def test_too_many_compositions_tries_the_weakest_split_alone():
    prof = profile(12)
    devs = devices(1.0, 0.5, 0.5, 0.5, 1.0, 1.0, 0.5, 1.0)
    h = split_hybrid(prof, devs, stages=4, global_batch=64, micro_batches=4, max_candidates=5)
    weakest = [StageDevice(name=f"s{s}", speed=min(devs[s].speed, devs[4 + s].speed)) for s in range(4)]
    assert h.sizes == split_pipeline(prof, weakest, micro_batches=4, micro_batch_size=8).sizes
    full = split_hybrid(prof, devs, stages=4, global_batch=64, micro_batches=4)
    assert full.samples_per_s >= h.samples_per_s      # the full search can only do better
