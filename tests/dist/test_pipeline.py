"""Pipelines (parallel='pp' in ht.prepare, the user's loop) give the big-batch training of one
process (real gloo process groups).

Reference (tests/pipeline_runs.py): the whole model in one process, on each step's global batch
from the job's sampler replayed, with the plain mean loss and SGD — independent of stages,
schedules, padding and weighting. Float64, so any real difference shows. Cases: the demo GPT (tied
embedding/head across stages) and a plain nn.Sequential stack; 2 and 3 stages; uneven block counts;
GPipe and 1F1B; micro-batches of unequal size (10 rows in 3, 3, 2, 2); grad_clip= over all stages;
blocks sized by emulated speeds, with their throttle; a device too small, stopping every rank.
Each test runs its jobs one after another in one set of processes (ranks start once).
"""

from __future__ import annotations

import pytest

from harness import run_ranks

pytestmark = pytest.mark.dist

EXACT = 1e-9


def worker(rank, world, runs):
    from pipeline_runs import join_group, pipeline_plan, train

    join_group()
    results = []
    for run in runs:
        run = dict(run)
        if "blocks" in run:        # the split given: a Plan, one replica of all ranks
            run["parallel"] = pipeline_plan("pp", blocks=run.pop("blocks"), schedule=run.pop("schedule"),
                                            shares=(run["global_batch"],), micro=(run.pop("micro"),), world=world)
        if run.pop("too_many_stages", False):   # a model with fewer blocks than ranks: every rank says so
            from hetrain.errors import UsageError

            try:
                train(**run)
                results.append("no error")
            except UsageError as e:
                results.append(str(e))
            continue
        results.append(train(**run))
    return results


def check_exact(r, *, steps: int = 2, in_flight: bool = True):
    assert r["steps"] == steps, r
    assert r["grad_error"] < EXACT and r["loss_error"] < EXACT, r
    if r["param_error"] is not None:
        assert r["param_error"] < EXACT, r
    # activations in flight are what the planner's memory model assumes for the schedule
    if in_flight:
        assert r["peak_in_flight"] == r["planned_in_flight"], r
    p, m = len(r["sizes"]), r["micro_batches"]
    assert r["bubble"] == pytest.approx((p - 1) / (m + p - 1))


GPT = dict(case="gpt", n=20, global_batch=10, steps=2)


def test_gpt_two_stages_gpipe_and_1f1b_uneven_blocks_micro_batches_and_clipping_then_speed_sized_blocks():
    from pipeline_runs import make_case

    runs = [dict(GPT, blocks=(3, 1), schedule="gpipe", micro=3),
            dict(GPT, blocks=(1, 3), schedule="1f1b", micro=3, grad_clip=0.05),
            # planned from the blocks' measured costs and the emulated speeds; then rank 1 gets too
            # small for any micro-batch: it shrinks 5 -> 2 -> 1, and every rank stops together
            dict(case="stack", n=30, global_batch=10, steps=3, parallel="pp", schedule="gpipe", micro_batches=2,
                 emulate="a100-80g:1.0,rtx3090:0.5", shrink_rank=1)]
    results = run_ranks(worker, 2, runs)
    gpipe, clipped, speed = zip(*results)
    names = set()
    for r in gpipe + clipped:
        check_exact(r)
        assert r["micro_batches"] == 4
        names.update(r["names"])
    assert [r["sizes"] for r in gpipe] == [(3, 1)] * 2 and [r["sizes"] for r in clipped] == [(1, 3)] * 2
    assert all(r["clipped"] for r in clipped)       # the clip acted on every step (norm over all stages)
    # every parameter of the model lives on some stage; the tied weight on both ends
    assert names == {k for k, _ in make_case("gpt", 1)[0].named_parameters()}
    assert all("tok.weight" in r["names"] for r in gpipe + clipped)
    # GPipe holds all 4 micro-batches; 1F1B holds p − stage (2 on stage 0, 1 on stage 1)
    assert [r["peak_in_flight"] for r in gpipe] == [4, 4]
    assert [r["peak_in_flight"] for r in clipped] == [2, 1]

    a100, rtx = speed
    for r in speed:
        check_exact(r, steps=1, in_flight=False)     # step 2 ran out of memory (below)
        assert r["activation_bytes"] > 0             # counted on emulated devices
        assert "out of memory with a micro-batch of 1 sample on rank 1 (" in r["error"], r["error"]
    assert a100["sizes"] == rtx["sizes"] and a100["sizes"][0] > a100["sizes"][1]   # the faster device: more blocks
    assert a100["micro"] == rtx["micro"] == 1        # the agreed shrink reached both stages
    assert a100["peak_in_flight"] == 10              # and its redo ran GPipe over 10 micro-batches of 1
    assert a100["slept_s"] == 0.0
    # the 0.5-speed device sleeps c·(1/0.5 − 1) = c for each piece of compute c, its stage's
    # forward and backward pieces among them
    assert rtx["slept_s"] == pytest.approx(rtx["throttled_s"], rel=1e-6)
    assert rtx["throttled_s"] >= rtx["compute_s"] > 0


def test_on_the_controlled_clock_each_piece_lasts_its_share_of_the_clock():
    # 50 ms a sample at speed 1, far above the tiny GPT's CPU time: a stage's forward and
    # backward of a micro-batch last its blocks' share of µ·50 ms ÷ speed, its waits inside
    clock = 0.05
    run = dict(GPT, parallel="pp", schedule="1f1b", micro_batches=2, emulate="a100-80g:1.0,rtx3090:0.5",
               emulate_sample_s=clock)
    results = run_ranks(worker, 2, [run])
    stages = [r for (r,) in results]
    for r in stages:
        check_exact(r)
    a100, rtx = stages
    assert a100["sizes"] == rtx["sizes"]
    # the split was sized from the blocks on the clock (PipelineProfile.on_clock): the stages'
    # micro-batch at speed 1 share µ x clock between them (no link: the runtime costs no sends)
    mu = a100["micro"]
    assert sum(a100["stage_s_at_speed_1"]) == pytest.approx(mu * clock, rel=1e-9)
    assert [r["clocked_micro_s"] for r in stages] == pytest.approx(a100["stage_s_at_speed_1"], rel=1e-9)
    # no sharing of the host's cores to predict: the waits are inside the sleeps
    assert "host_cores" not in a100["predicted"]
    for r in stages:
        # each piece lasts the longer of its clocked length and its wall time (Throttle.pay_clocked),
        # so the stage was busy at least its micro-batches' clocked seconds and at most those plus
        # its compute (and each sleep's wake-up, 20 ms allowed a piece on a busy host)
        clocked = r["steps"] * r["micro_batches"] * r["clocked_micro_s"] / r["speed"]
        pieces = 2 * r["steps"] * r["micro_batches"]
        assert clocked <= r["busy_s"] <= clocked + r["compute_s"] + 0.02 * pieces, r
    assert a100["clocked_micro_s"] > rtx["clocked_micro_s"]     # the faster device runs more of the model


def test_sequential_three_stages_gpipe_and_1f1b_and_too_many_stages():
    stack = dict(case="stack", n=20, global_batch=10, steps=2)
    runs = [dict(stack, blocks=(1, 3, 2), schedule="gpipe", micro=3),
            dict(stack, blocks=(2, 1, 3), schedule="1f1b", micro=3, grad_clip=0.1),
            dict(stack, case="stack2", parallel="pp", too_many_stages=True)]
    results = run_ranks(worker, 3, runs)
    gpipe, f1b, too_many = zip(*results)
    names = set()
    for r in gpipe + f1b:
        check_exact(r)
        names.update(r["names"])
    assert all(r["clipped"] for r in f1b)
    assert len(names) == 12                     # 6 blocks × (weight, bias), each on one stage
    assert [r["sizes"] for r in gpipe] == [(1, 3, 2)] * 3
    assert [r["peak_in_flight"] for r in f1b] == [3, 2, 1]
    for message in too_many:
        assert "3 pipeline stages but the model has 2 block(s)" in message, message
