"""Byte sizes as people write them ('2GiB', '512MB', '1.5g') and back."""

from __future__ import annotations

import re

from ..errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, *, what: str = "size") -> int:
    """'2GiB' -> 2147483648. Bare numbers are bytes; k/m/g/t alone are binary (GiB)."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(
            f"cannot read {what} {text!r}",
            "write a number with a unit, e.g. 512MiB, 2GiB, 24GB",
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise UsageError(f"{what} {text!r} is zero", "give a positive size, e.g. 2GiB")
    return int(value)


def format_bytes(n: float) -> str:
    """2147483648 -> '2.0 GiB' (binary units, one decimal)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def compact(values, *, sep: str = "/", limit: int = 8) -> str:
    """'12/8/8' for a few values; for many, each distinct value with its count, in order of first
    appearance ('12 ×256, 8 ×512 (768 values)'), so a 1,024-device line stays readable."""
    items = [str(v) for v in values]
    if len(items) <= limit:
        return sep.join(items)
    counts: dict[str, int] = {}
    for v in items:
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{v} ×{n}" for v, n in counts.items()) + f" ({len(items)} values)"


def device_kinds(labels, *, limit: int = 6) -> str:
    """'a100-80g#0, rtx3090#1' for a few devices; for many, each kind with its count
    ('rtx3090 ×256, t4 ×256'): the label up to its '#'."""
    labels = list(labels)
    if len(labels) <= limit:
        return ", ".join(labels)
    return compact([label.split("#")[0].split(" ")[0] for label in labels], limit=0).rsplit(" (", 1)[0]


MANY_DEVICES = 16       # tables with more devices than this: one row per kind of device


def by_kind(items, *, label, same, many: int = MANY_DEVICES) -> list[list]:
    """Items grouped for a table: each alone when there are at most `many`; else one group per
    kind of device (label(item) up to its '#') with the same `same(item)`, in first-seen order."""
    items = list(items)
    if len(items) <= many:
        return [[i] for i in items]
    groups: dict[tuple, list] = {}
    for i in items:
        groups.setdefault((label(i).split("#")[0], same(i)), []).append(i)
    return list(groups.values())
