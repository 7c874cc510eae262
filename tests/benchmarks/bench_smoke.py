"""Every benchmark under benchmarks/ (found by glob: a new one is covered without a list), run as
CI runs it: `python benchmarks/X.py --smoke --json TMP`, tiny sizes through its own code path, so
an API change that breaks a benchmark fails here. A file starting with _ is a shared module, not a
benchmark. The test files split the list between them (PARTS, by index in the sorted list), so
`-n 2 --dist loadfile` runs two smokes at a time and no one file holds most of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# A smoke takes seconds of CPU; this bounds a hung one, not its speed (a 2-core host shared by other
# jobs ran accuracy's 36 s of CPU past 300 s of wall).
TIMEOUT_S = 600

PARTS = 7          # test_bench_smoke_a.py .. _g.py: two smokes a file, none past ~60 s of CPU (loadfile schedules files)


def benchmarks(part: int, parts: int = PARTS) -> list[str]:
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    return names[part::parts]


def results_state() -> dict:
    return {p.name: p.stat().st_mtime_ns for p in (BENCHMARKS / "results").iterdir()}


def run_smoke(name: str, tmp_path: Path) -> None:
    """The smoke exits 0 and writes a non-empty JSON at the path given, under tmp_path, leaving
    benchmarks/results alone."""
    out = tmp_path / f"{name}.json"
    before = results_state()
    env = {**os.environ, "HETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    said = (proc.stdout[-2000:] + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke exited {proc.returncode}:\n{said}"
    assert out.is_file(), f"benchmarks/{name}.py --smoke wrote no JSON at --json:\n{said}"
    assert json.loads(out.read_text()), f"benchmarks/{name}.py --smoke wrote an empty JSON"
    assert results_state() == before, f"benchmarks/{name}.py --smoke changed benchmarks/results"
