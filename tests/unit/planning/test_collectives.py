"""Collective and point-to-point times over a link, worked by hand; and their callers (pipeline
sends, the DP all-reduce of the layout comparison)."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.planning.collectives import (FREE_LINK, Link, all_gather_seconds, allreduce_seconds,
                                          link_from_measurement, reduce_scatter_seconds, send_seconds)
from hetrain.planning.parallelism import compare_parallelism
from hetrain.runtime.layouts.pipeline.split import PipelineProfile, evaluate_split

from pipeline_cases import devices, profile

GB = 1e9
TEN = Link(bandwidth_gbs=10.0, latency_s=0.0)        # 10 GB/s, no latency
SLOW_HOPS = Link(bandwidth_gbs=10.0, latency_s=1e-3)  # 10 GB/s, 1 ms a hop


def test_all_reduce_of_1_gb_over_4_devices_at_10_gbs():
    # 2·3/4 · 1 GB / 10 GB/s = 0.15 s; 2·3 hops of 1 ms on top
    assert allreduce_seconds(4, 1 * GB, TEN) == pytest.approx(0.15)
    assert allreduce_seconds(4, 1 * GB, SLOW_HOPS) == pytest.approx(0.156)
    assert allreduce_seconds(2, 1 * GB, TEN) == pytest.approx(0.1)       # 2·1/2 · 0.1


def test_reduce_scatter_and_all_gather_are_half_an_all_reduce_each():
    # 3/4 · 1 GB / 10 GB/s = 0.075 s; 3 hops of 1 ms
    assert reduce_scatter_seconds(4, 1 * GB, TEN) == pytest.approx(0.075)
    assert all_gather_seconds(4, 1 * GB, TEN) == pytest.approx(0.075)
    assert reduce_scatter_seconds(4, 1 * GB, SLOW_HOPS) == pytest.approx(0.078)
    assert all_gather_seconds(4, 1 * GB, SLOW_HOPS) == pytest.approx(0.078)


def test_a_send_is_one_hop_of_the_whole_message():
    assert send_seconds(1 * GB, TEN) == pytest.approx(0.1)
    assert send_seconds(1 * GB, SLOW_HOPS) == pytest.approx(0.101)
    assert send_seconds(0, SLOW_HOPS) == pytest.approx(1e-3)


def test_one_device_and_a_free_link_cost_nothing():
    for collective in (allreduce_seconds, reduce_scatter_seconds, all_gather_seconds):
        assert collective(1, 1 * GB, SLOW_HOPS) == 0.0
        assert collective(8, 1 * GB, FREE_LINK) == 0.0
    assert send_seconds(1 * GB, FREE_LINK) == 0.0


def test_a_measured_all_reduce_gives_back_the_bandwidth():
    measured = link_from_measurement(4, 1 * GB, 0.15, "test")
    assert measured.bandwidth_gbs == pytest.approx(10.0) and measured.latency_s == 0.0
    assert link_from_measurement(1, 1 * GB, 0.15, "test") == Link(bandwidth_gbs=float("inf"), latency_s=0.0,
                                                                    source="test")
    with pytest.raises(UsageError):
        Link(bandwidth_gbs=10.0, latency_s=-1.0)


def test_pipeline_stages_pay_two_sends_per_micro_batch():
    # 2 blocks of 1 ms/sample, micro-batches of 2 samples, 1 MB per sample across the boundary,
    # 1 GB/s and 1 ms a hop: stage 0 computes 2 ms and sends 2 MB forward and its gradient back,
    # 2 · (2 MB / 1 GB/s + 1 ms) = 6 ms; the last stage sends nothing.
    prof = PipelineProfile(blocks=profile(2, seconds=1e-3, act=0.0, params=0.0).blocks, boundary_bytes=1e6)
    link = Link(bandwidth_gbs=1.0, latency_s=1e-3)
    split = evaluate_split(prof, devices(1.0, 1.0), (1, 1), micro_batches=2, micro_batch_size=2, link=link)
    assert [s.seconds_per_micro for s in split.stages] == pytest.approx([8e-3, 2e-3])
    free = evaluate_split(prof, devices(1.0, 1.0), (1, 1), micro_batches=2, micro_batch_size=2)
    assert [s.seconds_per_micro for s in free.stages] == pytest.approx([2e-3, 2e-3])


def test_data_parallel_pays_a_ring_all_reduce_of_the_gradients():
    # 8 blocks of 4 MB of parameters: 32 MB of gradients over 2 devices at 1 GB/s = 32 ms
    choice = compare_parallelism(profile(8), devices(1.0, 1.0), global_batch=16,
                                 link=Link(bandwidth_gbs=1.0, latency_s=0.0))
    dp = next(c for c in choice.candidates if c.kind == "dp")
    assert "gradient all-reduce 32 ms" in dp.detail
    # 16 samples of 8 ms each split 8/8: 64 ms of compute + 32 ms of sync
    assert dp.samples_per_s == pytest.approx(16 / 0.096)
