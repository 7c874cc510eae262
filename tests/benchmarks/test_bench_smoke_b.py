"""Part 2 of 7 of the benchmarks' smokes (bench_smoke.py says what each checks and how
they are split into test_bench_smoke_a.py .. _g.py)."""

from __future__ import annotations

import pytest

from bench_smoke import benchmarks, run_smoke


@pytest.mark.parametrize("name", benchmarks(1))
def test_the_benchmark_runs_its_smoke_and_writes_its_json(name, tmp_path):
    run_smoke(name, tmp_path)
