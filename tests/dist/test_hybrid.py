"""DP × PP (parallel='dp-pp' in ht.prepare, the user's loop) on a 2×2 mesh (4 ranks) gives the
big-batch training of one process, with replicas computing uneven shares of the global batch (by
throughput, or given in a Plan).

Reference (tests/pipeline_runs.py): the whole demo GPT in one process on each step's global batch
from the job's sampler replayed, float64 and SGD. Each replica's pipeline holds the tied
embedding/head weight on both ends; grad_clip= clips the norm over every stage of the model.
"""

from __future__ import annotations

import os

import pytest

from harness import run_ranks

pytestmark = pytest.mark.dist

# replica 0 = two fast devices, replica 1 = two half-speed ones: by throughput, shares 2 : 1
CLUSTER = "a100-80g:1.0,a100-80g:1.0,rtx3090:0.5,rtx3090:0.5"
EXACT = 1e-9


def worker(rank, world):
    from pipeline_runs import join_group, pipeline_plan, train

    join_group()
    gpt = dict(case="gpt", n=24, global_batch=12, steps=2)
    planned = train(**gpt, parallel="dp-pp", stages=2, micro_batches=2, schedule="1f1b", emulate=CLUSTER)
    # given: blocks 3/1, shares 3 (micro-batches 2 + 1, padded to 2) and 9 (5 + 4, padded to 5)
    given = train(**gpt, grad_clip=0.05, parallel=pipeline_plan("dp-pp", blocks=(3, 1), schedule="gpipe",
                                                               shares=(3, 9), micro=(2, 5), world=world))
    return planned, given


def test_dp_x_pp_matches_one_big_batch_with_uneven_replica_shares_and_clipping():
    results = run_ranks(worker, 4, timeout=240)
    planned, given = zip(*results)
    # The pipelines' own prediction: four emulated stages on this host's cores, each stretched by
    # the others computing beside it (emulation/sharing.py), the same on every rank.
    got = planned[0]["predicted"]
    assert all(r["predicted"] == got for r in planned), [r["predicted"] for r in planned]
    cores = len(os.sched_getaffinity(0))
    if cores < 4:
        assert got["host_cores"] == cores and got["stage_stretch"] > 1.0, got
        assert got["step_s"] > got["alone_step_s"] > 0, got
    # ... stretched from the fill-drain step of the slowest replica the stages were built from
    assert got.get("alone_step_s", got["step_s"]) == pytest.approx(max(r["split_step_s"] for r in planned)), got
    for r in planned + given:
        assert r["steps"] == 2, r
        assert r["grad_error"] < EXACT and r["loss_error"] < EXACT and r["param_error"] < EXACT, r
        assert "tok.weight" in r["names"]          # the tied weight on both ends of each pipeline
        assert r["peak_in_flight"] == r["planned_in_flight"], r
    assert [(r["replica"], r["stage"]) for r in planned] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # planned: one split for both replicas, the fast replica gets twice the slow one's share
    assert len({r["sizes"] for r in planned}) == 1
    assert [r["share"] for r in planned] == [8, 8, 4, 4]
    assert [r["micro"] for r in planned] == [4, 4, 2, 2]
    # given
    assert [r["share"] for r in given] == [3, 3, 9, 9] and [r["micro"] for r in given] == [2, 2, 5, 5]
    assert all(r["sizes"] == (3, 1) for r in given)
    assert all(r["clipped"] for r in given)        # the norm of every stage of both replicas, agreed
    assert [r["peak_in_flight"] for r in given] == [2, 2, 2, 2]    # GPipe: both micro-batches
