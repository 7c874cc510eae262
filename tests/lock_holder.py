"""A second "job": another process holding one of hetrain's directory locks until it is killed.

It loads lock.py alone, by its path, so it starts in a fraction of a second (no torch import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LOCK_PY = Path(__file__).resolve().parents[1] / "src" / "hetrain" / "runtime" / "resilience" / "lock.py"
HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", sys.argv[3])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
lock, who = mod.try_lock(sys.argv[1], sys.argv[2])
print("held" if lock else who, flush=True)
time.sleep(300)
"""


def hold(directory, name: str) -> subprocess.Popen:
    """The holding process, once it holds the lock (kill it to free the lock)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), name, str(LOCK_PY)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "held":
        proc.kill()
        raise AssertionError(f"the holder did not get the lock: {line}")
    return proc
