"""hetrain's processes skip the interpreter's final full collection: the heap is frozen at exit,
after the handlers registered later (the Engine's) have run, and the `hetrain` command does it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# A handler registered before hetrain's runs after it (atexit is LIFO), one registered after runs
# before it: each prints how many objects were frozen when it ran.
PROBE = """
import atexit, gc
atexit.register(lambda: print("last", gc.get_freeze_count()))
{body}
atexit.register(lambda: print("before", gc.get_freeze_count()))
"""


def _run(body: str) -> dict[str, int]:
    code = PROBE.format(body=body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert out.returncode == 0, out.stderr
    seen = dict(line.split() for line in out.stdout.splitlines() if line.startswith(("last", "before")))
    return {k: int(v) for k, v in seen.items()}


def test_the_heap_is_frozen_at_exit_after_later_handlers_ran():
    seen = _run("from hetrain.process_exit import skip_final_collection\n"
                "skip_final_collection(); skip_final_collection()")
    assert seen["before"] == 0          # a later handler (the Engine's exit handler) runs first
    assert seen["last"] > 1000          # then the heap is frozen


def test_the_command_freezes_its_heap_at_exit():
    seen = _run("from hetrain.cli import main\n"
                "try:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert seen["last"] > 1000
