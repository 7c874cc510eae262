"""DP × PP splits with shares by pipeline throughput, and the DP / PP / DP×PP choice (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from hetrain.errors import UsageError
from hetrain.hardware.cluster import parse_cluster
from hetrain.planning.parallelism import compare_parallelism, evaluate_hybrid, split_hybrid
from hetrain.runtime.layouts.pipeline.split import PipelineProfile, stage_devices

from pipeline_cases import compositions, devices, profile

GIB = 1024**3


def test_hybrid_shares_follow_pipeline_throughput():
    prof = profile(8)
    devs = devices(1.0, 1.0, 0.5, 0.5)     # replica 0 fast, replica 1 half as fast
    h = split_hybrid(prof, devs, stages=2, global_batch=60, micro_batches=4)
    assert h.sizes == (4, 4)
    assert h.shares == (40, 20)
    assert [r.micro_batch_size for r in h.replicas] == [10, 5]
    assert h.replicas[0].step_seconds == pytest.approx(h.replicas[1].step_seconds)
    given_shares = evaluate_hybrid(prof, devs, (4, 4), stages=2, global_batch=60, micro_batches=4, shares=(30, 30))
    assert given_shares.samples_per_s < h.samples_per_s
    with pytest.raises(UsageError, match="do not form pipelines of 3"):
        split_hybrid(prof, devs, stages=3, global_batch=60, micro_batches=4)
    with pytest.raises(UsageError, match="shares"):
        evaluate_hybrid(prof, devs, (4, 4), stages=2, global_batch=60, micro_batches=4, shares=(59, 1))


def test_hybrid_split_is_common_and_best_for_mixed_replicas():
    prof = profile(6)
    devs = devices(1.0, 0.5, 0.5, 1.0)      # the replicas are mirror images
    h = split_hybrid(prof, devs, stages=2, global_batch=40, micro_batches=4)
    rates = {sizes: evaluate_hybrid(prof, devs, sizes, stages=2, global_batch=40, micro_batches=4).samples_per_s
             for sizes in compositions(6, 2)}
    assert h.samples_per_s == pytest.approx(max(rates.values()))


def test_compare_picks_dp_when_the_model_fits_and_says_why():
    prof = profile(8, params=1e6)
    choice = compare_parallelism(prof, devices(1.0, 0.5, memory=24 * GIB), global_batch=32)
    assert choice.choice.kind == "dp"
    assert "samples/s predicted" in choice.reason
    assert {c.kind for c in choice.candidates} == {"dp", "pp"}
    assert choice.describe()[0].startswith("parallelism: DP")
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.reason = "x"


def test_compare_picks_model_parallelism_when_dp_does_not_fit():
    prof = profile(8, params=1 * GIB, act=1e6)          # 8 GiB of parameters, 32 GiB with Adam
    devs = devices(1.0, 0.5, 1.0, 0.5, memory=24 * GIB)
    choice = compare_parallelism(prof, devs, global_batch=32, micro_batches=4)
    dp = next(c for c in choice.candidates if c.kind == "dp")
    assert not dp.fits and "whole model" in dp.detail
    assert choice.choice.kind in ("pp", "dp×pp") and choice.choice.fits
    assert "DP does not fit memory" in choice.reason
    names = {c.name for c in choice.candidates}
    assert {"DP", "DP×PP 2×2", "PP 4 stages"} <= names


def test_compare_with_nothing_fitting_is_a_usage_error():
    prof = profile(2, params=10 * GIB)
    with pytest.raises(UsageError) as e:
        compare_parallelism(prof, devices(1.0, 1.0, memory=24 * GIB), global_batch=8)
    assert "no layout fits memory" in e.value.what and "DP:" in e.value.what
    assert "FSDP" in e.value.fix


def test_compare_prefers_the_simpler_layout_when_close():
    prof = profile(8, params=1e3, act=1.0)
    choice = compare_parallelism(prof, devices(1.0, 1.0, 1.0, 1.0), global_batch=64, link=None)
    assert choice.choice.kind == "dp"          # DP is the fastest here (no bubble)
    fastest = max(c.samples_per_s for c in choice.candidates)
    assert choice.choice.samples_per_s >= 0.95 * fastest


def test_compare_from_a_cluster_spec_and_a_whole_model_profile():
    """What `hetrain plan` feeds it: the --cluster devices and a per-sample profile of the model."""
    devs = stage_devices(parse_cluster("a100-80g:1.0,rtx3090:0.5@16GiB"))
    assert [(d.speed, d.memory_bytes) for d in devs] == [(1.0, 80 * GIB), (0.5, 16 * GIB)]
    prof = PipelineProfile.uniform(n_blocks=24, seconds_per_sample=0.02, activation_bytes_per_sample=2e8,
                                   param_bytes=6 * GIB)           # 24 GiB with Adam: not on the 16 GiB card
    choice = compare_parallelism(prof, devs, global_batch=64, micro_batches=8)
    assert choice.choice.kind == "pp" and choice.choice.sizes[0] > choice.choice.sizes[1]
    assert "DP does not fit memory" in choice.reason
    with pytest.raises(UsageError, match="n_blocks"):
        PipelineProfile.uniform(n_blocks=0, seconds_per_sample=1, activation_bytes_per_sample=1, param_bytes=1)


def test_micro_batch_cut_is_what_the_runtime_runs():
    from hetrain.runtime.layouts.pipeline.split import micro_batch_cut
    from hetrain.planning.plan import DevicePlan

    # 19 samples asked in 8: micro-batches of 3, and 7 of them hold all 19 (not 8 of 3: 24 rows)
    assert micro_batch_cut(19, 8, stages=2, schedule="1f1b") == (3, 7)
    assert micro_batch_cut(64, 8, stages=2, schedule="1f1b") == (8, 8)
    # 1F1B needs a micro-batch per stage: 9 in 8 would be 5 of 2 over 8 stages, so 9 of 1
    assert micro_batch_cut(9, 8, stages=8, schedule="1f1b") == (1, 9)
    assert micro_batch_cut(9, 8, stages=8, schedule="gpipe") == (2, 5)
    for share in range(8, 80):
        for m in (4, 8):
            for stages, schedule in ((2, "1f1b"), (4, "1f1b"), (4, "gpipe")):
                if share < m:
                    continue
                mu, n = micro_batch_cut(share, m, stages=stages, schedule=schedule)
                plan = DevicePlan(rank=0, device="d", speed=1.0, share=share, micro_batch=mu)
                assert plan.n_micro == n and (n - 1) * mu < share <= n * mu     # no empty micro-batch
                assert schedule == "gpipe" or n >= stages


def test_dp_pp_costs_the_micro_batches_each_replica_runs():
    """Replica shares 19/13 asked in 8 micro-batches run as 7 of 3 and 7 of 2: the step is costed
    for 7 (one fixed cost and one row-padding fewer than 8 of ⌈share/8⌉)."""
    prof = profile(4)
    devs = devices(1.0, 1.0, 0.67, 0.67)
    h = evaluate_hybrid(prof, devs, (2, 2), stages=2, global_batch=32, micro_batches=8, shares=(19, 13))
    assert [(r.micro_batch_size, r.micro_batches) for r in h.replicas] == [(3, 7), (2, 7)]
    eight = evaluate_hybrid(prof, devs, (2, 2), stages=2, global_batch=32, micro_batches=8, shares=(16, 16))
    assert [(r.micro_batch_size, r.micro_batches) for r in eight.replicas] == [(2, 8), (2, 8)]
    t = h.replicas[0].stages[0].seconds_per_micro
    assert h.replicas[0].step_seconds == pytest.approx((7 + 1) * t)   # two equal stages: (n + p − 1) pieces
