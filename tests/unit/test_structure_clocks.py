"""One home for clocks: every time read in runtime/ goes through runtime/devices/clock.py.

On CUDA a kernel runs after the host call that launched it returns, so a raw host clock around
device work measures its launch (and any sync inside, everything queued before it). The clock
home reads device work on the device's clock (events, or a synchronize first); anything else is
the host's or the calendar's, said so by name. So a raw read of the `time` module's clocks (or
datetime's now) anywhere else in runtime/ is a defect this test names."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "src" / "hetrain" / "runtime"
HOME = RUNTIME / "devices" / "clock.py"
CLOCKS = {"time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time",
          "process_time_ns", "thread_time", "thread_time_ns", "clock_gettime", "clock_gettime_ns"}
DATETIME_NOW = {"now", "utcnow", "today"}


def raw_clock_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every read of a clock in `source` that is not through the clock home."""
    tree = ast.parse(source)
    aliases = {"time": set(), "datetime": set()}     # names the modules (or datetime's class) go by
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in aliases:
                    aliases[a.name].add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime") and not node.level:
            for a in node.names:
                if node.module == "time" and a.name in CLOCKS:
                    found.append((node.lineno, f"from time import {a.name}"))
                elif node.module == "datetime" and a.name == "datetime":
                    aliases["datetime"].add(a.asname or a.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = ast.unparse(node.value)
        if base in aliases["time"] and node.attr in CLOCKS:
            found.append((node.lineno, f"{base}.{node.attr}"))
        elif node.attr in DATETIME_NOW and (base in aliases["datetime"] or base.endswith(".datetime")
                                            or base.split(".")[-1] in aliases["datetime"]):
            found.append((node.lineno, f"{base}.{node.attr}"))
    return sorted(found)


def test_every_clock_read_in_runtime_goes_through_the_clock_home():
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path == HOME:
            continue
        found += [f"{path.relative_to(RUNTIME)}:{line}: {what}" for line, what in raw_clock_reads(path.read_text())]
    assert not found, ("raw clock reads in runtime/ (read time through runtime/devices/clock.py: DeviceClock "
                       "for device work, host(), thread_cpu() or wall() for the rest):\n" + "\n".join(found))


def test_the_rule_finds_each_way_of_reading_a_clock():
    source = """
import time
import time as t
import datetime
from time import perf_counter
from datetime import datetime as dt
a = time.perf_counter()
b = t.thread_time()
c = time.time()
d = datetime.datetime.now()
e = dt.utcnow()
f = time.monotonic
time.sleep(1)
x = datetime.timedelta(seconds=1)
"""
    found = [what for _, what in raw_clock_reads(source)]
    assert found == ["from time import perf_counter", "time.perf_counter", "t.thread_time", "time.time",
                     "datetime.datetime.now", "dt.utcnow", "time.monotonic"], found


def test_the_clock_home_is_where_the_reads_are():
    assert raw_clock_reads(HOME.read_text())      # what the rule exempts is where they live
