"""benchmarks/chaos.py's fault schedule for every layout, checked without launching (the benchmark
itself launches; the launched path of each fault kind is tested elsewhere: kills, hangs and
truncated checkpoints in tests/cli/test_restart.py, OOMs in every layout in tests/dist/test_oom_*.py,
test_layouts.py and the seed's case). The schedule must be one the runtime can survive: faults
parse as the runtime reads them, each restart-causing fault fires in its own attempt, no kill
mid-backward under a pipeline (its backward runs in the schedule), OOMs within each group's halvings."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from hetrain.runtime.devices.faults import parse_faults

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["dp", "zero1", "fsdp", "capacity", "capacity-full", "pp", "dp-pp", "tp",
                                    "pp-resplit"])
def test_twenty_faults_per_layout_are_a_schedule_the_runtime_can_survive(layout):
    chaos = load_chaos()
    specs = chaos.schedule(20, 30, 3, 0, layout)
    faults = parse_faults(";".join(specs))
    assert len(faults) == 20
    kinds = Counter(f.kind for f in faults)
    assert kinds["die"] and kinds["stall"] and kinds["oom"]
    case = chaos.LAYOUTS[layout]
    # an OOM restarts the job where in-loop recovery is off (TP, capacity-full)
    restarts = sorted((f for f in faults if f.kind != "oom" or case.oom_restarts), key=lambda f: f.step)
    assert [f.attempt for f in restarts] == list(range(len(restarts)))     # one attempt each, in step order
    assert len({f.step for f in restarts}) == len(restarts)
    assert all(f.step % 3 == 0 for f in restarts if f.phase == "checkpoint")
    if case.resplit:        # the first attempt runs long enough to re-split
        assert min(f.step for f in restarts) >= chaos.RESPLIT_FROM
    if case.parallel in ("pp", "dp-pp"):
        assert all(f.phase != "backward" for f in faults if f.kind == "die")
    groups, budget = chaos.oom_budget(layout)
    for group in groups:       # each group's micro-batch can halve `budget` times before it is 1
        assert sum(1 for f in faults if f.kind == "oom" and f.rank in group) <= budget
    world = sum(len(g) for g in groups)
    assert all(0 <= f.rank < world for f in faults)
