"""A checkpoint's manifest: what it holds (size and sha256 of every file), read defensively.

Anything in a checkpoint directory may be foreign or damaged, so reading a manifest never
raises: a malformed one (not an object, wrong types, missing keys, a file name that leaves the
directory, a negative size, bad hex, another step's) makes the checkpoint "not usable", with the
reason, and the previous one is tried. Only a manifest hetrain wrote in a format this version
does not read is refused outright (`Refused`): falling back past it would silently resume from
older state than the newest run left.

Format history ("format" in manifest.json and meta.pt):
    1  before the field existed: {"step", "files", "saved_at"}
    2  + "format", "kind"; each rank hashed the files it wrote
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

FORMAT = 2
READS = (1, 2)
KIND = "hetrain-checkpoint"
MANIFEST = "manifest.json"
META = "meta.pt"
DCP_METADATA = ".metadata"
REQUIRED = (META, DCP_METADATA)
_HEX = re.compile(r"[0-9a-f]{64}")
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class Refused:
    """A hetrain checkpoint of a format this version cannot read (UsageError's what and fix)."""
    what: str
    fix: str


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def owner(name: str, world_size: int) -> int:
    """Which rank hashes (on save) and checks (on load) the file: the rank that wrote a DCP file
    (`__<rank>_<n>.distcp`), rank 0 for .metadata and meta.pt, else one chosen by the name alone
    (so ranks that list the directory at different moments still agree)."""
    if name in REQUIRED:
        return 0
    m = _DCP_FILE.fullmatch(name)
    if m and int(m.group(1)) < world_size:
        return int(m.group(1))
    return zlib.crc32(name.encode()) % world_size


def share(names, rank: int, world_size: int) -> list[str]:
    return sorted(n for n in names if owner(n, world_size) == rank)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad_name(name) -> str | None:
    if not isinstance(name, str) or not name:
        return f"a file name {name!r} that is not a name"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name == MANIFEST:
        return f"a file name {name!r} outside the checkpoint"
    return None


def parse(data, step: int) -> dict | str | Refused:
    """{name: {"bytes", "sha256"}} from a decoded manifest of the checkpoint of `step`, or why
    it is not usable (a string), or Refused. Never raises."""
    if not isinstance(data, dict):
        return f"the manifest is a JSON {type(data).__name__}, not an object"
    fmt = data.get("format", 1)
    if "format" in data or "kind" in data:
        if data.get("kind") != KIND:
            return f"the manifest is not hetrain's (kind {data.get('kind')!r})"
        if not _is_int(fmt):
            return f"the manifest's format {fmt!r} is not a number"
        if fmt not in READS:
            return Refused(f"the checkpoint is hetrain format {fmt}; this hetrain reads formats "
                           f"{', '.join(map(str, READS))}",
                           "resume it with the hetrain version that wrote it (or a newer one), "
                           "or move it out of the checkpoint directory to start from an older one")
    if data.get("step") != step or not _is_int(data.get("step")):
        return f"the manifest names step {data.get('step')!r}, not {step}"
    files = data.get("files")
    if not isinstance(files, dict):
        return f"the manifest's files are a {type(files).__name__}, not an object"
    for name in REQUIRED:
        if name not in files:
            return f"the manifest does not list {name}"
    for name, entry in files.items():
        bad = _bad_name(name)
        if bad:
            return f"the manifest lists {bad}"
        if not isinstance(entry, dict):
            return f"the manifest's entry for {name} is not an object"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if not _is_int(size) or size < 0:
            return f"the manifest gives {name} a size of {size!r}"
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            return f"the manifest gives {name} a checksum {digest!r} that is not sha256 hex"
    return {name: {"bytes": e["bytes"], "sha256": e["sha256"]} for name, e in files.items()}


def read(path: Path, step: int) -> dict | str | Refused:
    """parse() of `path`/manifest.json. Never raises."""
    import json

    manifest = path / MANIFEST
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        return "no manifest (it was never completed)"
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable manifest ({e})"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        return f"unreadable manifest ({e})"
    return parse(data, step)


def check(path: Path, files: dict) -> str | None:
    """None if every listed file is there with its size and checksum, else the first problem.
    Never raises (a peer may be waiting for this rank's answer)."""
    for name in sorted(files):
        want = files[name]
        f = path / name
        try:
            if not f.is_file():
                return f"{name} is missing"
            size = f.stat().st_size
            if size != want["bytes"]:
                return f"{name} has {size} bytes, expected {want['bytes']} (truncated?)"
            if sha256(f) != want["sha256"]:
                return f"{name} does not match its checksum (corrupt)"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
    return None


def verify(path: Path, step: int | None = None) -> str | Refused | None:
    """One process checks the whole checkpoint at `path` (step-NNNNNNNN): None if whole, else the
    reason (or Refused). The Checkpointer splits the same work over the ranks."""
    if step is None:
        try:
            step = int(Path(path).name.split("-")[1])
        except (IndexError, ValueError):
            return f"{Path(path).name} is not a checkpoint name"
    files = read(Path(path), step)
    if not isinstance(files, dict):
        return files
    return check(Path(path), files)


def write_manifest(directory: Path, data: dict) -> None:
    """manifest.json, synced: it is what makes the checkpoint count, so it is written last."""
    import json
    import os

    with open(directory / MANIFEST, "w") as f:
        f.write(json.dumps(data, indent=1))
        f.flush()
        os.fsync(f.fileno())
