"""benchmarks/accuracy.py: a row compares the median prediction with the median run; the
controlled clock's rows are judged against the target and the wall clock's only reported, with
the runs' own spread; bad input is one line before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def acc(benchmark_module):
    return benchmark_module("accuracy")


def run(samples_per_s: float) -> dict:
    """A data-parallel run's summary, as the worker writes it, with only what compare() reads."""
    return {"steady_samples_per_s": samples_per_s, "samples_per_s": samples_per_s, "global_batch": 32,
            "ranks": [{"peak_bytes": 100, "ooms": 0}, {"peak_bytes": 80, "ooms": 0}],
            "step_seconds": [0.2] * 4, "shares": [20, 12], "micro_batches": [20, 12], "predicted": {},
            "steady_busy_s": [0.1, 0.1], "redone_steps": 0}


def pred(samples_per_s: float, peak: float = 100.0) -> dict:
    return {"name": "DP", "fits": True, "samples_per_s": samples_per_s, "memory": [peak, 80.0], "detail": "-"}


def test_a_clocked_row_is_judged_by_its_median_against_the_target(acc):
    row = acc.compare("dp", "a:1,b:0.5", [pred(104.0)] * 3, [run(100.0), run(99.0), run(101.0)], clocked=True)
    assert row["speed_error"] == pytest.approx(104 / 100 - 1)
    assert row["measured_spread"] == pytest.approx(2 / 100)
    assert row["gated"] and row["pass"] and "PASS" in acc.table([row])
    over = acc.compare("dp", "a:1,b:0.5", [pred(107.0)] * 3, [run(100.0)] * 3, clocked=True)
    assert not over["pass"] and "MISS" in acc.table([over]) and "not gated" not in acc.table([over])


def test_a_wall_row_reports_its_error_and_spread_but_is_not_gated(acc):
    row = acc.compare("dp", "a:1,b:0.5", [pred(130.0)] * 3, [run(90.0), run(100.0), run(115.0)], clocked=False)
    assert row["speed_error"] == pytest.approx(0.30)
    assert row["measured_spread"] == pytest.approx(25 / 100)
    assert row["pass"] and not row["gated"] and "PASS (not gated)" in acc.table([row])
    result = {"clocks": {"wall": {"clocked": False, "layouts": [row], "max_speed_error": 0.30}},
              "load_average": (0.5, 0.5, 0.5)}
    assert "wall: max samples/s error 30.0% (not gated), the runs of one plan moved 25%-25%" in acc.headline(result)


def test_a_memory_miss_or_an_unplanned_oom_fails_the_row_on_either_clock(acc):
    big = acc.compare("dp", "a:1,b:0.5", [pred(100.0, peak=130.0)], [run(100.0)], clocked=False)
    assert big["memory_error"] == pytest.approx(0.30) and not big["pass"]
    oom = run(100.0)
    oom["ranks"][1]["ooms"] = 1
    row = acc.compare("dp", "a:1,b:0.5", [pred(100.0)], [oom], clocked=True)
    assert row["fail"] == "1 unplanned OOM(s)" and "FAIL" in acc.table([row])


def test_the_rounds_start_their_runs_at_layouts_spread_over_the_list(acc):
    names = list(acc.ALL)
    three = [acc.run_order(names, r, 3) for r in range(3)]
    assert [o[0] for o in three] == ["dp", "capacity", "dp-pp"]
    assert all(sorted(o) == sorted(names) for o in three)
    assert acc.run_order(names, 0, 1) == names


def test_an_unknown_layout_is_one_line_naming_the_known_ones_and_smoke_says_it_wins(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "accuracy.py"), "--json", str(tmp_path / "x.json"),
                           "--smoke", "--steps", "30", "--layouts", "dp,nope"], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and not (tmp_path / "x.json").exists()
    assert lines == ["accuracy.py: --steps ignored: --smoke sets its own sizes (steps 4)",
                     "accuracy.py: error: --layouts dp,nope: unknown nope; known: "
                     "dp, fsdp, capacity, pp, dp-pp, tp, dp-capped, dp-3dev, all"]
