"""benchmarks/host_gauge.py: the share of a run during which the host itself was slow, and the
watch that times it beside a run (layout_accuracy.py's --max-host-burst repeats a run on it)."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def gauge(benchmark_module):
    return benchmark_module("host_gauge")


def test_a_steady_host_has_no_burst(gauge):
    passes = [14.0, 14.6, 15.1, 14.2, 15.5, 14.9, 14.3, 15.0, 14.4, 15.2]
    assert gauge.burst_share(passes) == 0.0


def test_the_share_counts_passes_slower_than_the_runs_fastest_quarter_by_the_threshold(gauge):
    quick, slow = [15.0] * 16, [24.0] * 4          # 1.6x: a burst
    assert gauge.burst_share(quick + slow) == pytest.approx(0.2)
    at = [15.0] * 9 + [15.0 * gauge.BURST_OVER]      # exactly at the threshold counts
    assert gauge.burst_share(at) == pytest.approx(0.1)
    below = [15.0] * 9 + [15.0 * gauge.BURST_OVER * 0.99]
    assert gauge.burst_share(below) == 0.0


def test_a_host_slow_for_most_of_a_run_reads_so(gauge):
    # against the run's median the slow passes would be the norm; against its fastest quarter not
    passes = [15.0] * 4 + [22.5] * 6
    assert gauge.burst_share(passes) == pytest.approx(0.6)


def test_too_few_passes_say_nothing(gauge):
    assert gauge.burst_share([15.0, 30.0, 15.0]) is None


def test_the_watch_times_passes_until_stopped(gauge):
    host = gauge.HostGauge("1,32,16", "HETRAIN_LAYOUT_ACCURACY_MODEL", procs=1)
    try:
        assert host.read("fp32") > 0                          # a reading still works beside it
        host.watch()
        time.sleep(6 * gauge.WATCH_PERIOD_S)
        passes = host.watched()
        assert len(passes) >= 2 and all(p > 0 for p in passes)
        assert host.read("fp32") > 0                          # and after it: the process serves on
        host.watch()                                          # a second watch starts afresh
        assert isinstance(host.watched(), list)
    finally:
        host.close()


def test_a_paced_reading_idles_after_each_pass_as_long_as_it_took(gauge):
    host = gauge.HostGauge("1,32,16", "HETRAIN_LAYOUT_ACCURACY_MODEL", procs=1)
    try:
        host.read("fp32")                                     # the process's start-up, out of the timing
        t0 = time.perf_counter()
        paced = host.read("fp32", paced=True)
        wall = time.perf_counter() - t0
        # every pass (RUNS and a warm-up) computed, then slept as long: twice their CPU at least,
        # where a flat-out reading takes once
        assert paced > 0 and wall >= 1.5 * (gauge.RUNS + 1) * paced
    finally:
        host.close()
