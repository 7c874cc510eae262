"""Training on asynchronous emulated devices (HETRAIN_EMULATE_ASYNC=1): each device's work
completes after the host call returns, as a GPU's does, its throttle paid only at the sync points
(runtime/devices/clock.py: a synchronize, the collectives hetrain issues, a pipeline stage's
sends). The rebalancer and the pipeline's online re-split read every device's time on its own
clock, so they still follow a slowed device. A host clock around a pipeline stage's pieces (the
old `timed`) reads their launch, and the split stays where it was (a data-parallel micro-batch
holds its sync point, the gradient all-reduce, so even a host clock around it sees the wait).

The same runs as tests/dist/test_oom_and_rebalance.py and test_pipeline_resplit.py, smaller:
shares and splits must move the right way, within the same tolerance, not match timings.

The two jobs run side by side, each in a process group of its own: both run on the controlled
clock, whose micro-batches last their clocked length whatever else the host runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import run_ranks

pytestmark = pytest.mark.dist

ASYNC = {"HETRAIN_EMULATE_ASYNC": "1"}
SLOW_AT = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"rebalance": [rank 0's, rank 1's], "resplit": [...]}, the two jobs side by side."""
    from dist.test_oom_and_rebalance import rebalance_worker

    cache = tmp_path_factory.mktemp("resplit") / "cache"
    with ThreadPoolExecutor(2) as pool:
        rebalance = pool.submit(run_ranks, rebalance_worker, 2, f"slow:rank=0,step={SLOW_AT},factor=2", 21, env=ASYNC)
        resplit = pool.submit(run_ranks, resplit_worker, 2, timeout=300, env={**ASYNC, "HETRAIN_CACHE": str(cache)})
        return {"rebalance": rebalance.result(), "resplit": resplit.result()}


def test_rebalancing_follows_a_slowdown_on_asynchronous_devices(runs):
    from dist.test_oom_and_rebalance import efficiency

    slow_at = SLOW_AT
    r0, r1 = runs["rebalance"]
    assert r0["shares"] == r1["shares"]
    reached = [efficiency(s, [1.0 / 2, 0.67]) for s in r0["shares"][slow_at + 10:]]
    assert min(reached) >= 0.95, (r0["shares"], reached)
    assert r0["plan"].version >= 1 and "rebalanced" in r0["plan"].note


def resplit_worker(rank, world):
    from dist.test_pipeline_resplit import equal_blocks, job
    from pipeline_runs import join_group

    join_group()
    job(steps=1, faults="")          # measures the blocks (then made equal, as the re-split test does)
    equal_blocks(rank)
    moving = job(steps=14)           # rank 1 (the last stage) 2x slower from step 3
    return {"first": moving["first_sizes"], "sizes": moving["sizes"],
            "steps": [s["sizes"] for s in moving["steps"]]}


def test_a_pipeline_re_splits_away_from_a_slowed_asynchronous_stage(runs):
    r0, r1 = runs["resplit"]
    assert r0["first"] == (3, 3) and r0["sizes"] == r1["sizes"]
    assert r0["sizes"][1] < 3, r0["steps"]          # blocks left the slowed stage, none came to it
    assert all(s[1] <= 3 for s in r0["steps"]), r0["steps"]
