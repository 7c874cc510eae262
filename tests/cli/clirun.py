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


def hetrain_here(*args: str, columns: str | None = "120") -> subprocess.CompletedProcess:
    """`hetrain ARGS` in this process (hetrain.cli.main), for commands that start no process and
    only read their input: the same exit code and output as `hetrain()` without a Python start and
    torch import (~1 s each). An exception main() does not turn into one line propagates, failing
    the test as a traceback would. `columns`: $COLUMNS during the call; None leaves it unset, as a
    shell that does not export it leaves a command whose output goes to a file."""
    import contextlib
    import io

    from hetrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    code, saved = 0, os.environ.get("COLUMNS")
    if columns is None:
        os.environ.pop("COLUMNS", None)
    else:
        os.environ["COLUMNS"] = columns     # as hetrain() sets it: the same line wrapping
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
    except SystemExit as e:
        if isinstance(e.code, str):     # what the interpreter does with SystemExit("text")
            err.write(e.code + "\n")
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.pop("COLUMNS", None) if saved is None else os.environ.__setitem__("COLUMNS", saved)
    return subprocess.CompletedProcess(["hetrain", *args], code, out.getvalue(), err.getvalue())


def one_line_error(result, *words):
    """A usage error as users must see it: exit 2, one `hetrain: error` line and its fix, no
    traceback, and each of `words` in it."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("hetrain: error")]
    assert len(errors) == 1, result.stderr
    assert "fix:" in result.stderr, result.stderr
    for w in words:
        assert w in result.stderr, result.stderr
