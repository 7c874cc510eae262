"""The manifest: a whole checkpoint verifies; a damaged, malformed or foreign one is a reason,
never an exception; a hetrain checkpoint of another format is refused."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.runtime.resilience.manifest import FORMAT, KIND, MANIFEST, Refused, verify

FILES = {".metadata": b"dcp index", "__0_0.distcp": b"x" * 100, "meta.pt": b"meta"}


def entries(files):
    return {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}


def make(tmp_path, files=FILES, *, step=2, fmt=FORMAT):
    d = tmp_path / f"step-{step:08d}"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    manifest = {"step": step, "files": entries(files)}
    if fmt != 1:
        manifest.update(format=fmt, kind=KIND)
    (d / MANIFEST).write_text(json.dumps(manifest))
    return d


def rewrite(d, manifest):
    (d / MANIFEST).write_text(json.dumps(manifest))
    return verify(d)


def test_a_whole_checkpoint_verifies_in_this_format_and_in_format_1(tmp_path):
    assert verify(make(tmp_path)) is None
    assert verify(make(tmp_path, step=4, fmt=1)) is None     # written before "format" existed


def test_truncated_corrupt_missing_and_unfinished(tmp_path):
    d = make(tmp_path)
    (d / "__0_0.distcp").write_bytes(b"x" * 50)
    assert "truncated" in verify(d)
    (d / "__0_0.distcp").write_bytes(b"y" * 100)
    assert "checksum" in verify(d)
    (d / "__0_0.distcp").unlink()
    assert "missing" in verify(d)
    (d / MANIFEST).unlink()
    assert "never completed" in verify(d)


GOOD = {"format": FORMAT, "kind": KIND, "step": 2, "files": entries(FILES)}


def broken(change):
    m = copy.deepcopy(GOOD)
    change(m)
    return m


@pytest.mark.parametrize("manifest, words", [
    ([], "JSON list"),
    ({"files": []}, "step"),
    ({"step": 2, "files": []}, "files are a list"),
    (broken(lambda m: m["files"]["meta.pt"].pop("bytes")), "size of None"),
    (broken(lambda m: m["files"].__setitem__("../../etc/passwd", m["files"]["meta.pt"])), "outside"),
    (broken(lambda m: m["files"].__setitem__("a/b", m["files"]["meta.pt"])), "outside"),
    (broken(lambda m: m["files"]["meta.pt"].__setitem__("bytes", -4)), "size of -4"),
    (broken(lambda m: m["files"]["meta.pt"].__setitem__("sha256", "zz" * 32)), "not sha256 hex"),
    (broken(lambda m: m.__setitem__("step", 3)), "names step 3"),
    (broken(lambda m: m.__setitem__("step", True)), "names step True"),
    (broken(lambda m: m["files"].pop(".metadata")), "does not list .metadata"),
    (broken(lambda m: m.__setitem__("kind", "someone-else")), "not hetrain's"),
    (broken(lambda m: m.__setitem__("format", "2")), "not a number"),
])
def test_a_malformed_or_foreign_manifest_is_a_reason(tmp_path, manifest, words):
    d = make(tmp_path)
    reason = rewrite(d, manifest)
    assert isinstance(reason, str) and words in reason, reason


def test_a_hetrain_manifest_of_another_format_is_refused_with_what_to_do(tmp_path):
    refused = rewrite(make(tmp_path), broken(lambda m: m.__setitem__("format", 99)))
    assert isinstance(refused, Refused)
    assert "format 99" in refused.what and "reads formats 1, 2" in refused.what and "version" in refused.fix


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2 ** 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
keys = st.sampled_from(["format", "kind", "step", "files", "bytes", "sha256", "meta.pt", ".metadata", "..", "a/b"])


@st.composite
def malformed(draw):
    """Arbitrary JSON, or the good manifest with one value somewhere in it replaced or removed."""
    if draw(st.booleans()):
        return draw(json_values | st.dictionaries(keys, json_values, max_size=5))
    m = copy.deepcopy(GOOD)
    node = m
    path = draw(st.lists(keys, min_size=1, max_size=3))
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            break
        node = node[key]
    if draw(st.booleans()):
        node.pop(path[-1], None)
    else:
        node[path[-1]] = draw(json_values)
    return m


@settings(max_examples=100, deadline=None)
@given(manifest=malformed())
def test_no_malformed_manifest_raises(tmp_path_factory, manifest):
    d = tmp_path_factory.mktemp("ck") / "step-00000002"
    d.mkdir()
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    (d / MANIFEST).write_text(json.dumps(manifest))
    result = verify(d)           # never raises
    if manifest == GOOD or (isinstance(manifest, dict) and _same_files(manifest)):
        return                   # the change left it whole (e.g. saved_at replaced)
    assert isinstance(result, (str, Refused)), (manifest, result)


def _same_files(m):
    files = m.get("files")
    same = isinstance(files, dict) and files.keys() == GOOD["files"].keys() and all(   # an extra key in an
        isinstance(files[n], dict) and all(files[n].get(k) == v for k, v in GOOD["files"][n].items())  # entry is ignored
        for n in files)
    return same and m.get("step") == 2 and m.get("format", 1) in (1, 2) \
        and (m.get("kind") == KIND or ("format" not in m and "kind" not in m))
