"""meta.pt loaded without running code: torch.load(weights_only=True), plus an allow-list.

A pickle can name any function to call while it loads, so a crafted meta.pt would run code on
every rank that resumed from it. weights_only=True unpickles only tensors, containers and
primitive types, plus the globals allowed here. What hetrain saves in meta.pt was checked
against it (tests/unit/runtime/resilience/test_safe_meta.py): the sampler's, the rebalancer's
and a GradScaler's state are dicts of numbers and lists; the Plan is its JSON text; RNG state
is a uint8 tensor and Python's random.getstate() tuple; torch's LR schedulers' state_dicts
(StepLR, LambdaLR, OneCycleLR, CosineAnnealingLR, ReduceLROnPlateau, CyclicLR, SequentialLR...)
hold numbers, strings, lists and dicts. torch's own defaults already admit all of these;
SAFE_GLOBALS names the few extra types state_dicts are known to carry, and a user who registers
state of another type allows it with torch.serialization.add_safe_globals before hetrain.init.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path

import torch

from .manifest import READS, Refused

SAFE_GLOBALS = (collections.OrderedDict, collections.defaultdict, collections.Counter, torch.Size)
REQUIRED = ("step", "sampler", "plan", "rng", "model_signature", "global_batch")
_MOVE = ("move the checkpoint out of the checkpoint directory (the previous one is used), or use another "
         "Checkpoints(dir=...)")


def load_meta(path: Path, *, step: int) -> dict | Refused:
    """The meta dict of the checkpoint of `step`, or why it is refused. Never raises."""
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            meta = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).splitlines()
        why = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
        return Refused(f"meta.pt would run code or build an object hetrain does not load ({why[:200]})",
                       "if that type is state you registered yourself, allow it with "
                       "torch.serialization.add_safe_globals([...]) before hetrain.init(); otherwise " + _MOVE)
    except Exception as e:   # noqa: BLE001  (rank 0 alone: every failure is reported on every rank)
        return Refused(f"meta.pt cannot be read ({type(e).__name__}: {str(e)[:200]})", _MOVE)
    if not isinstance(meta, dict):
        return Refused(f"meta.pt holds a {type(meta).__name__}, not hetrain's record", _MOVE)
    fmt = meta.get("format", 1)
    if fmt not in READS:
        return Refused(f"meta.pt is hetrain format {fmt!r}; this hetrain reads formats {', '.join(map(str, READS))}",
                       "resume it with the hetrain version that wrote it, or " + _MOVE)
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        return Refused(f"meta.pt lacks {', '.join(missing)}", _MOVE)
    if meta["step"] != step:
        return Refused(f"meta.pt is of step {meta['step']!r}, its directory of step {step}", _MOVE)
    return meta
