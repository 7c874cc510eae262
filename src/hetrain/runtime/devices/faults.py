"""Fault injection, for tests, demos and the chaos benchmark: make a device slow down, run out of
memory at a chosen micro-batch, die, or hang, at a chosen step.

Spec (the config's `faults` field, `hetrain run --faults`, or the HETRAIN_FAULTS environment variable),
faults separated by ';':
    slow:rank=1,step=5,factor=2          rank 1 computes 2x slower from step 5 on
    noise:rank=-1,step=0,factor=0.1      every rank's compute times vary ±10% around their mean
    oom:rank=0,step=3,micro=0            OutOfMemoryError in the forward of rank 0's first
                                         micro-batch of step 3 (micro=-1: the last one)
    oom:rank=1,step=3,micro=-1,phase=backward   ... in the middle of that micro-batch's backward
    oom:...,escape=1                     raised outside hetrain's recovery (the user's code has no
                                         `with mb:`), so the job restarts from its checkpoint
    die:rank=1,step=7                    SIGKILL rank 1 at the start of step 7
    die:rank=1,step=7,phase=backward     ... halfway through its last micro-batch's backward, when part
                                         of the gradient sync has started (peers are inside it)
    die:rank=0,step=8,phase=checkpoint   ... while the checkpoint after step 8 is being written
    stall:rank=0,step=4                  SIGSTOP rank 0 (a hang) at the start of step 4
rank=-1 means every rank. With HETRAIN_FAULT_LOG set to a file, every fault that fires is appended to it (one JSON line)
before it acts. Every fault but `slow` and `noise` fires once, in restart attempt `attempt` (default 0) of the job, so a
restarted job replays the step cleanly.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass

import torch

from . import clock as clocks
from ...errors import UsageError
from ...hardware.cluster import MAX_DEVICES

ENV = "HETRAIN_FAULTS"
LOG_ENV = "HETRAIN_FAULT_LOG"
KINDS = ("slow", "noise", "oom", "die", "stall")
_FIELDS = {"rank": int, "step": int, "micro": int, "factor": float, "attempt": int,
           "phase": str, "escape": int}
# What a fault may say. Beyond these a spec is a typo, and a run would sleep ~forever (a slowdown of
# 1e9) or overflow; slowdowns multiply, so their product on a rank is bounded too.
_BOUNDS = {"rank": (-1, MAX_DEVICES - 1), "step": (0, 10**9), "micro": (-1024, 1023), "attempt": (0, 1000),
           "escape": (0, 1)}
FACTORS = {"slow": (0.01, 100.0), "noise": (0.0, 0.9)}   # slow: (lo, hi]; noise: [lo, hi]
MAX_SLOWDOWN = 1000.0


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    rank: int
    step: int
    micro: int = 0             # oom: which micro-batch of the step on that rank (-1: last)
    phase: str = "forward"     # oom: forward | backward; die: start | backward | checkpoint
    factor: float = 2.0        # slow: compute time multiplier
    attempt: int = 0           # restart attempt in which it fires (not for slow)
    escape: int = 0            # oom: 1 = outside hetrain's recovery

    def __str__(self) -> str:
        extra = {"slow": f" x{self.factor:g}", "oom": f" micro {self.micro} {self.phase}"}.get(self.kind, "")
        return f"{self.kind} on rank {self.rank} at step {self.step}{extra}"


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    faults = []
    for item in (spec or "").split(";"):
        item = item.strip()
        if not item:
            continue
        kind, _, rest = item.partition(":")
        if kind not in KINDS:
            raise UsageError(f"unknown fault kind {kind!r} in {item!r}", f"use one of {', '.join(KINDS)}")
        fields = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, _, value = pair.partition("=")
            if key not in _FIELDS:
                raise UsageError(f"unknown fault field {key!r} in {item!r}", f"use {', '.join(_FIELDS)}")
            try:
                fields[key] = _FIELDS[key](value)
            except ValueError:
                raise UsageError(f"fault field {key}={value!r} in {item!r} is not a {_FIELDS[key].__name__}",
                                 "e.g. oom:rank=1,step=3,micro=-1,phase=backward") from None
        if "rank" not in fields or "step" not in fields:
            raise UsageError(f"fault {item!r} needs rank= and step=", "e.g. die:rank=1,step=7")
        _check_bounds(kind, item, fields)
        phases = {"oom": ("forward", "backward"), "die": ("start", "backward", "checkpoint")}.get(kind)
        if phases and kind == "die":
            fields.setdefault("phase", "start")
        if kind == "noise":
            fields.setdefault("factor", 0.1)     # Fault's default (2.0, a slowdown) is no noise amplitude
        if "phase" in fields and (phases is None or fields["phase"] not in phases):
            raise UsageError(f"fault phase {fields['phase']!r} in {item!r}",
                             f"{kind} takes phase=" + " | ".join(phases) if phases else f"{kind} takes no phase")
        faults.append(Fault(kind=kind, **fields))
    for rank in {f.rank for f in faults}:
        product = 1.0
        for f in faults:
            if f.kind == "slow" and f.rank in (rank, -1):
                product *= f.factor
        if product > MAX_SLOWDOWN:
            raise UsageError(f"the slowdowns of rank {rank} multiply to {product:g}, over {MAX_SLOWDOWN:g}",
                             "give fewer or smaller slow: factors")
    return tuple(faults)


def _check_bounds(kind: str, item: str, fields: dict) -> None:
    for key, (lo, hi) in _BOUNDS.items():
        if key in fields and not lo <= fields[key] <= hi:
            raise UsageError(f"fault field {key}={fields[key]} in {item!r} is out of range",
                             f"give {key} from {lo} to {hi}")
    if "factor" in fields:
        lo, hi = FACTORS.get(kind, FACTORS["slow"])
        factor = fields["factor"]
        inside = (lo <= factor <= hi) if kind == "noise" else (lo < factor <= hi)   # also NaN, inf
        if not inside:
            raise UsageError(f"fault field factor={factor:g} in {item!r} is out of range",
                             f"{kind} takes a factor in {'[' if kind == 'noise' else '('}{lo:g}, {hi:g}]")


class FaultInjector:
    """This rank's faults; the device hooks that inject them ask it wherever one can fire."""

    def __init__(self, faults: tuple[Fault, ...], *, rank: int, attempt: int):
        self.faults = [f for f in faults if f.rank in (rank, -1)]
        self.attempt = attempt
        self._fired: set[Fault] = set()

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _take(self, kind: str, step: int, **match) -> Fault | None:
        for f in self.faults:
            if (f.kind == kind and f.step == step and f.attempt == self.attempt and f not in self._fired
                    and all(getattr(f, k) == v for k, v in match.items())):
                self._fired.add(f)
                _log_fired(f)
                return f
        return None

    def slowdown(self, step: int) -> float:
        """The compute-time multiplier in force at this step (1.0: none)."""
        factor = 1.0
        for f in self.faults:
            if f.kind == "slow" and step >= f.step:
                factor *= f.factor
        return factor

    def noise(self, step: int) -> float:
        """The timing-noise amplitude in force at this step (0: none)."""
        return max((f.factor for f in self.faults if f.kind == "noise" and step >= f.step), default=0.0)

    def at_step_start(self, step: int) -> None:
        self.maybe_die(step, "start")
        if self._take("stall", step):
            os.kill(os.getpid(), signal.SIGSTOP)

    def due(self, kind: str, step: int, **match) -> bool:
        """Whether a fault would fire here, without firing it."""
        return any(f.kind == kind and f.step == step and f.attempt == self.attempt and f not in self._fired
                   and all(getattr(f, k) == v for k, v in match.items()) for f in self.faults)

    def maybe_die(self, step: int, phase: str) -> None:
        if self._take("die", step, phase=phase):
            os.kill(os.getpid(), signal.SIGKILL)

    def oom(self, step: int, micro: int, count: int, phase: str, *, escape: int) -> Fault | None:
        """An OOM fault for this micro-batch (index `micro` of `count`) and phase, if one is due."""
        if escape:
            return self._take("oom", step, escape=1)
        for index in (micro, micro - count):     # match micro=k or micro=-1 style
            f = self._take("oom", step, micro=index, phase=phase, escape=0)
            if f:
                return f
        return None


def _log_fired(fault: Fault) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({**asdict(fault), "time": clocks.wall()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def injected_oom(fault: Fault) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"injected fault: {fault}")
