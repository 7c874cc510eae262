"""`hetrain run` with its launcher in this process: hetrain.cli.main runs torchrun's agent here and
the agent starts the workers as real processes, as a launched `hetrain run` does, without the
launcher's own Python start and torch import (~3 s of CPU a launch).

For launches nothing signals and nothing kills (tests that signal or lose the launcher start it
as a process: clirun.hetrain, node_launch.Node). What the launcher changes in this process for
the run (its environment, torchrun's signal handlers) is put back afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile

from clirun import SRC

# torchrun's process context turns these into its SignalException for the run's length
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _out_of_time(signum, frame):
    raise subprocess.TimeoutExpired(["hetrain", "run"], None)


def hetrain_run_here(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`hetrain run ARGS`: its exit code, and stdout and stderr as a launched one's (the workers
    inherit this process's descriptors 1 and 2, so both are redirected to files for the call).
    After `timeout` seconds TimeoutExpired is raised in the launcher's loop, as clirun.hetrain's
    subprocess.run raises it; torchrun's agent stops its workers on the way out."""
    from hetrain.cli import main

    saved_env, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (*_SIGNALS, signal.SIGALRM)}
    os.environ.update({"PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                       "COLUMNS": "120", **(env or {})})
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    code = 0
    with tempfile.TemporaryFile("a+") as out, tempfile.TemporaryFile("a+") as err:
        try:
            signal.signal(signal.SIGALRM, _out_of_time)
            signal.setitimer(signal.ITIMER_REAL, timeout)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            with open(1, "w", buffering=1, closefd=False) as o, open(2, "w", buffering=1, closefd=False) as e, \
                    contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                try:
                    main(["run", *args])
                except SystemExit as stop:
                    if isinstance(stop.code, str):
                        e.write(stop.code + "\n")
                    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            for fd in kept:
                os.close(fd)
            os.environ.clear()
            os.environ.update(saved_env)
            for s, h in handlers.items():
                signal.signal(s, h)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["hetrain", "run", *args], code, out.read(), err.read())
