"""The scripts under benchmarks/ import their shared module (_common.py) by name, with their folder
on sys.path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def benchmark_module():
    """import_module with benchmarks/ on sys.path (as the benchmarks run; spawned processes
    inherit it)."""
    sys.path.insert(0, str(BENCHMARKS))
    yield importlib.import_module
    sys.path.remove(str(BENCHMARKS))
