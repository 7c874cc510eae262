"""Where hetrain keeps what it learns about a machine (profiles, host facts), and how it writes
a file so that a crash or a second writer never leaves half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path

CACHE_ENV = "HETRAIN_CACHE"   # a directory, or off/0/none to keep nothing


def cache_dir(kind: str) -> Path | None:
    """$HETRAIN_CACHE/<kind> (default ~/.cache/hetrain/<kind>), or None when caching is off."""
    root = os.environ.get(CACHE_ENV)
    if root is not None and root.strip().lower() in ("", "0", "off", "none", "no"):
        return None
    base = Path(root) if root else Path.home() / ".cache" / "hetrain"
    return base / kind


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """A one-line UsageError now, before any work, when `path` cannot be written later."""
    from .errors import UsageError

    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a directory", "give a file path")
    if not parent.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: the directory {str(parent)!r} does not exist",
                         "create it first, or give a path in an existing directory")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {str(path)!r}: the directory {str(parent)!r} is not writable",
                         "give a path you can write")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write aside (a name unique to this process), then rename over `path`: readers see the old
    file or the new one, never a mix, also when several ranks write the same file at once."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)


def write_json_atomic(path: str | os.PathLike, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))
