"""benchmarks/layout_accuracy.py: a row compares the median prediction with the median run, and a
row whose runs of the same plan moved more than its target is marked noisy, in the JSON, the
table and the headline."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def acc(benchmark_module):
    return benchmark_module("layout_accuracy")


def run(samples_per_s: float) -> dict:
    """A data-parallel run's summary, as the worker writes it, with only what compare() reads."""
    return {"steady_samples_per_s": samples_per_s, "samples_per_s": samples_per_s, "global_batch": 32,
            "ranks": [{"peak_bytes": 100, "ooms": 0}, {"peak_bytes": 80, "ooms": 0}],
            "step_seconds": [0.2] * 4, "shares": [20, 12], "micro_batches": [20, 12], "other_work_cores": 0.0,
            "attempts": 1, "predicted": {}, "steady_busy_s": [0.1, 0.1], "steady_compute_s": [0.05, 0.05],
            "redone_steps": 0}


def pred(samples_per_s: float) -> dict:
    return {"name": "DP", "fits": True, "samples_per_s": samples_per_s, "memory": [100.0, 80.0], "detail": "-"}


def test_a_row_whose_runs_held_still_is_judged_and_quiet(acc):
    row = acc.compare("dp", "a:1,b:0.5", [pred(105.0)] * 3, [run(100.0), run(99.0), run(101.0)])
    assert row["speed_error"] == pytest.approx(105 / 100 - 1)
    assert row["measured_spread"] == pytest.approx(2 / 100)
    assert row["quiet"] and row["pass"]
    assert "PASS" in acc.table([row]) and "noisy" not in acc.table([row])


def test_a_row_whose_runs_moved_more_than_the_target_is_marked_noisy(acc):
    # the same plan ran at 90, 100 and 115 samples/s: 25% apart, beyond the 10% target
    row = acc.compare("dp", "a:1,b:0.5", [pred(100.0)] * 3, [run(90.0), run(100.0), run(115.0)])
    assert row["measured_spread"] == pytest.approx(25 / 100)
    assert row["pass"] and not row["quiet"]          # its error is 0, but the host could not say so
    assert "PASS (noisy: runs 25% apart)" in acc.table([row])


def test_the_headline_counts_the_quiet_rows_beside_the_error(acc):
    quiet = acc.compare("dp", "a:1,b:0.5", [pred(100.0)] * 3, [run(100.0)] * 3)
    noisy = acc.compare("pp", "a:1,b:0.5", [pred(100.0)] * 3, [run(80.0), run(100.0), run(120.0)])
    result = {"clocks": {"wall": {"clocked": False, "target": acc.SPEED_TARGET, "layouts": [quiet, noisy],
                                  "max_speed_error": 0.0}},
              "load_average": (0.5, 0.5, 0.5)}
    line = acc.headline(result)
    assert "moved 0%-40% round to round, within the target on 1 of 2 rows" in line
    assert "marked noisy" in line


def test_the_rounds_start_their_runs_at_layouts_spread_over_the_list(acc):
    names = ["dp", "fsdp", "capacity", "pp", "dp-pp", "tp"]
    three = [acc.run_order(names, r, 3) for r in range(3)]
    assert [o[0] for o in three] == ["dp", "capacity", "dp-pp"]          # not the same layout first twice
    assert three[1] == ["capacity", "pp", "dp-pp", "tp", "dp", "fsdp"]
    six = [acc.run_order(names, r, 6) for r in range(6)]
    assert [o[0] for o in six] == names                                   # as many rounds: each first once
    assert all(sorted(o) == sorted(names) for o in three + six)           # and every round runs them all
    assert acc.run_order(names, 0, 1) == names


def test_one_round_has_no_spread_so_no_mark(acc):
    row = acc.compare("dp", "a:1,b:0.5", [pred(100.0)], [run(80.0)])
    assert row["measured_spread"] is None and row["quiet"] is None
    assert "noisy" not in acc.table([row]) and "MISS" in acc.table([row])
