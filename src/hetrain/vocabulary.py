"""The words a job is configured with, defined once: every module that checks or lists them
imports them from here."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import UsageError

PRECISIONS = ("fp32", "bf16", "fp16")                 # what a device computes in
PRECISION_REQUESTS = ("auto",) + PRECISIONS           # what a user may ask for


def check_choice(value: object, allowed: Sequence[str], where: str) -> str:
    """`value` when it is one of `allowed`; else a one-line UsageError that lists them."""
    if value not in allowed:
        raise UsageError(f"{where} {value!r} is not one of {', '.join(allowed)}")
    return value  # type: ignore[return-value]
