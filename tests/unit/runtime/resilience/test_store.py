from __future__ import annotations

import hashlib
import json

from hetrain.runtime.resilience.store import MANIFEST, verify


def make(tmp_path, files):
    d = tmp_path / "step-00000002"
    d.mkdir()
    manifest = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / MANIFEST).write_text(json.dumps({"step": 2, "files": manifest}))
    return d


def test_a_whole_checkpoint_verifies(tmp_path):
    assert verify(make(tmp_path, {"a.distcp": b"x" * 100, "meta.pt": b"meta"})) is None


def test_truncated_corrupt_missing_and_unfinished(tmp_path):
    d = make(tmp_path, {"a.distcp": b"x" * 100, "meta.pt": b"meta"})
    (d / "a.distcp").write_bytes(b"x" * 50)
    assert "truncated" in verify(d)
    (d / "a.distcp").write_bytes(b"y" * 100)
    assert "checksum" in verify(d)
    (d / "a.distcp").unlink()
    assert "missing" in verify(d)
    (d / MANIFEST).unlink()
    assert "never completed" in verify(d)
