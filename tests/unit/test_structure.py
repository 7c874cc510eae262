"""The package's structure, as rules a change must keep: no module reaches into another object's
underscore attributes, modules stay small, and imports point down the layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "hetrain"
# torch / stdlib internals hetrain must use, each for a stated reason:
ALLOWED = {
    "torch._foreach_mul_": "one fused in-place multiply of every gradient (reduce.scale_gradients)",
    "os._exit": "a worker stopping on an error skips teardown: its peers may already be gone",
    "ddp.reducer._reset_state": "DDP has no public way to run a forward again after a broken backward",
    "self.ddp.reducer._get_zeros_like_grad_buckets": "the buckets an OOM left unsent, to complete with zeros",
    "torch._utils": "torch's flatten/unflatten of dense tensors (pipeline gradient exchange)",
}
ACCESS = re.compile(r"\b((?:\w+\.)*\w+)\.(_[A-Za-z]\w*)")


def _code_lines(path: Path):
    """(line number, text) of code, without comments and docstrings."""
    tree = ast.parse(path.read_text())
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant) \
                and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if i not in doc_lines:
            yield i, line.split("#", 1)[0]


def test_no_module_reads_or_writes_another_objects_underscore_attributes():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for i, line in _code_lines(path):
            for base, attr in ACCESS.findall(line):
                if base in ("self", "cls") or attr.startswith("__") or f"{base}.{attr}" in ALLOWED:
                    continue
                found.append(f"{path.relative_to(SRC)}:{i}: {base}.{attr}")
    assert not found, "private attributes used from outside their object:\n" + "\n".join(found)


def test_every_module_stays_under_400_lines():
    long = [f"{p.relative_to(SRC)}: {n}" for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, long


def test_the_engine_coordinates_in_at_most_250_lines():
    engine = next(SRC.rglob("engine.py"))
    assert len(engine.read_text().splitlines()) <= 250
