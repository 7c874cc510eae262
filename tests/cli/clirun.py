"""Run the `hetrain` command as a user would, with this checkout's code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def hetrain(*args: str, timeout: float = 240, cwd: str | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "COLUMNS": "120", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hetrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
