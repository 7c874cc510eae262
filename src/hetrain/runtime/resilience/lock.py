"""One job per directory: an exclusive fcntl.flock on a lock file inside it.

The kernel releases a flock when the last descriptor of it closes, so a holder killed by
SIGKILL (a torchrun restart, an OOM kill) frees it with no stale-lock cleanup, and the next
attempt of the same job takes it again. The file records who holds it (pid and host; when, the
file's modification time: the module imports nothing of the package, so a process can load it
alone), so a second job can say whose it is in one line; the file itself is never removed (removing
it while another process waits on it would let two jobs hold two different files).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

RUN_LOCK = ".hetrain-run.lock"            # the `hetrain run` launcher's, in the run dir
CHECKPOINT_LOCK = ".hetrain-checkpoints.lock"   # rank 0's, in checkpoint_dir

# Locks this process holds, by file: one Engine at a time per process, so a second Engine in the
# same process (a test, a notebook) takes over the first one's lock instead of refusing itself
# (flock treats two descriptors of one process as two holders).
_held: dict[str, DirLock] = {}


class DirLock:
    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        _held.pop(str(self.path), None)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None


def holder(path: Path) -> str:
    """'pid N on host H since T' from the lock file, or what is known."""
    try:
        rec = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
        return f"pid {int(rec['pid'])} on host {rec['host']} (since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def try_lock(directory: str | os.PathLike, name: str) -> tuple[DirLock | None, str | None]:
    """(the lock, None), or (None, who holds it). OSError when the file cannot be opened."""
    path = Path(directory) / name
    mine = _held.get(str(path))
    if mine is not None:
        mine.release()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, holder(path)
    except BaseException:
        os.close(fd)
        raise
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    lock = DirLock(path, fd)
    _held[str(path)] = lock
    return lock, None
