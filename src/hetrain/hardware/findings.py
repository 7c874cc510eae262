"""What `hetrain doctor` reports: findings, and the options its checks read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import UsageError
from ..vocabulary import PRECISION_REQUESTS, check_choice

LEVELS = ("ok", "warn", "error", "skipped")      # skipped: the check could not run (reason in message)
PSU_HEADROOM = 0.30     # the seed's rule: the PSU should carry the GPUs' power limits + 30%


@dataclass(frozen=True, kw_only=True)
class Finding:
    level: str                                  # ok | warn | error | skipped
    check: str                                  # e.g. 'p2p'
    message: str                                # what was found
    why: str = ""                               # why it matters
    fix: str = ""                               # the exact fix ('' when nothing to do)
    env: tuple[tuple[str, str], ...] = field(default=())   # env vars that apply the fix at launch

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"Finding.level {self.level!r} is not one of {LEVELS}")

    def to_dict(self) -> dict:
        return {"level": self.level, "check": self.check, "message": self.message, "why": self.why,
                "fix": self.fix, "env": {k: v for k, v in self.env}}


class EnvFix(NamedTuple):
    """One environment variable the launcher sets (or keeps, when the user set it), and why."""

    var: str
    value: str
    reason: str


def kept_or_set(var: str, value: str, reason: str, environ) -> EnvFix:
    """`var=value` with its reason; a variable already in `environ` is the user's choice and kept."""
    if var in environ:
        return EnvFix(var, environ[var], f"{var}={environ[var]}: kept as you set it (hetrain would set "
                                         f"{value}: {reason})")
    return EnvFix(var, value, f"{var}={value}: {reason}")


def skipped(check: str, reason: str, fix: str = "") -> Finding:
    return Finding(level="skipped", check=check, message=reason, fix=fix)


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    psu_watts: float | None = None              # the power supply's rating, to check headroom
    precision: str = "auto"                     # the precision the job will use ('auto': recommend)
    rank_versions: tuple[dict, ...] | None = None   # under torchrun: every rank's versions

    def __post_init__(self) -> None:
        if self.psu_watts is not None and not (isinstance(self.psu_watts, (int, float))
                                               and math.isfinite(self.psu_watts) and self.psu_watts > 0):
            raise UsageError(f"--psu-watts {self.psu_watts!r} is not a positive number of watts",
                             "give the power supply's rating, e.g. --psu-watts 1600")
        check_choice(self.precision, PRECISION_REQUESTS, "--precision")


def parse_psu_watts(text: str | None) -> float | None:
    """'1600', '1600W', '1.6kW' -> watts; anything else is a one-line UsageError."""
    if text is None:
        return None
    s = str(text).strip().lower().replace(" ", "")
    scale = 1000.0 if s.endswith("kw") else 1.0
    s = s[:-2] if s.endswith("kw") else s[:-1] if s.endswith("w") else s
    try:
        watts = float(s) * scale
    except ValueError:
        watts = float("nan")
    if not (math.isfinite(watts) and watts > 0):
        raise UsageError(f"--psu-watts {text!r} is not a positive number of watts",
                         "give the power supply's rating, e.g. --psu-watts 1600")
    return watts
