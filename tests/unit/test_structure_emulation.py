"""The CPU emulator lives in its own package (src/hetrain/emulation/, docs/architecture.md "The
emulator"): the planner never imports it, the modules that do are few and named here, what
emulated devices share reaches the planner through their profiles (DeviceProfile.host), never as
planner options, and the emulator's words stay out of the rest of the package."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from hetrain.planning.options import PlanOptions

SRC = Path(__file__).resolve().parents[2] / "src" / "hetrain"
PACKAGE = SRC / "emulation"
WORDS = re.compile(r"emulat|clocked|host_cores|throttle|contention", re.IGNORECASE)
# Files outside the package that may speak of emulation. The goal is fewer than 15; each file brought
# under it lowers this, and a file that starts speaking of emulation fails here.
MOST_FILES_WITH_WORDS = 11
# The modules that import the emulator, each for what it takes; a new one is a decision, made here.
IMPORTERS = {
    "runtime/engine.py": "the one factory of a job's device hooks; an emulated device's process and host facts; "
                         "the nodes joined with each node's --emulate spec (emulation/islands.py); "
                         "the emulated inter-node link refused on real GPUs",
    "runtime/measure/measurements.py": "what devices sharing the host make of the measurements (measuring.py)",
    "cli/train.py": "the --emulate option, its link and fault checks (emulation/cli.py)",
    "cli/planning.py": "the --emulate option and the controlled clock's hidden options",
    "cli/bench.py": "the --emulate option, one machine's devices, the no-GPU error",
    "cli/sweep.py": "the --emulate option, the controlled clock, the no-GPU error, the emulated slots' target",
}


def _imported(path: Path) -> set[str]:
    """The hetrain modules a file imports, relative imports resolved, wherever in the file."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _imports_emulation(path: Path) -> bool:
    return any(m == "hetrain.emulation" or m.startswith("hetrain.emulation.") for m in _imported(path))


def test_the_planner_never_imports_the_emulator():
    wrong = [str(p.relative_to(SRC)) for p in sorted((SRC / "planning").rglob("*.py")) if _imports_emulation(p)]
    assert not wrong, "planning/ imports the emulator (give what it needs through the profiles):\n" + "\n".join(wrong)


def test_only_the_named_modules_import_the_emulator():
    found = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if PACKAGE not in p.parents and _imports_emulation(p)}
    assert found <= set(IMPORTERS), f"new importers of hetrain.emulation (name each in IMPORTERS): {found - set(IMPORTERS)}"
    assert found >= set(IMPORTERS), f"IMPORTERS names modules that no longer import it (drop them): {set(IMPORTERS) - found}"


def test_plan_options_hold_no_emulator_figures():
    names = {f.name for f in dataclasses.fields(PlanOptions)}
    emulator = {"contention", "contention_at", "host_cores", "host_load", "clocked", "ddp_cost", "straggle",
                "straggle_stretch"}
    assert not names & emulator, f"PlanOptions fields that belong to the emulator's SharedHost: {names & emulator}"


def test_the_emulators_words_stay_in_its_package():
    speaking = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*")
                      if p.is_file() and p.suffix in (".py", ".toml") and PACKAGE not in p.parents
                      and WORDS.search(p.read_text()))
    assert len(speaking) <= MOST_FILES_WITH_WORDS, (
        f"{len(speaking)} files outside hetrain/emulation speak of emulation (at most {MOST_FILES_WITH_WORDS}):\n"
        + "\n".join(speaking))
