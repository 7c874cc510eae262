"""Launch a multi-node job on loopback: one `hetrain run` per node, each in its own session (so a
node can be lost whole: its launcher and its workers), joined by one c10d rendezvous."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import free_port

SRC = Path(__file__).resolve().parents[2] / "src"


class Node:
    def __init__(self, name: str, args: list[str], log: Path, env: dict | None = None):
        self.name, self.log = name, log
        full_env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "COLUMNS": "120", **(env or {})}
        self._out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "hetrain", "run", *args], stdout=self._out,
                                     stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    def lose(self) -> None:
        """The node is gone: SIGKILL to its launcher and every process under it (torchrun starts
        workers in sessions of their own, so the launcher's group alone would leave them)."""
        for pid in reversed(_tree(self.proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.lose()


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def finish(nodes: list[Node], timeout: float) -> list[int]:
    """Every node's exit code; any node still running after that is lost (so none outlives a test)."""
    try:
        return [n.wait(timeout) for n in nodes]
    finally:
        for n in nodes:
            n.stop()


def job_flags(nnodes: str, port: int, *, restarts: int = 0, last_call: float = 30) -> list[str]:
    return ["--nnodes", nnodes, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-last-call", str(last_call),
            "--max-restarts", str(restarts)]


def wait_for(predicate, what: str, nodes: list[Node], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or all(n.proc.poll() is not None for n in nodes):
            raise AssertionError(f"gave up waiting for {what}:\n" + "\n".join(
                f"--- {n.name} (exit {n.proc.poll()}):\n{n.text()[-3000:]}" for n in nodes))
        time.sleep(0.1)


__all__ = ["Node", "finish", "free_port", "job_flags", "wait_for"]
