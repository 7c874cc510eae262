"""Cluster specs: `a100-80g,rtx3090` or `a100-80g:1.0,rtx3090:0.67@1GiB`.

Grammar, one item per device, comma separated:  [COUNTx]NAME[:SPEED][@MEMORY]
  NAME    a catalog GPU ('a100-80g', '3090', 'NVIDIA GeForce RTX 3090')
  SPEED   relative training speed in (0.01, 100], overriding the catalog's speed index
  MEMORY  memory cap from 1KiB to 1PiB, e.g. 2GiB or 512MiB (default: the catalog card's memory)
  COUNTx  that many identical devices, e.g. 2xrtx3090 (at most 1024 devices in all)

Used by `--emulate` (one throttled CPU process per device) and by `hetrain simulate --cluster`.

Speeds are on the catalog's scale (A100-80GB SXM = 1.0), and one CPU thread plays an A100: an
RTX 3090 (0.67) computes at 0.67 of the thread's pace, alone or beside others. Only a cluster with
a device faster than 1.0 is rescaled, so that its fastest device runs at the thread's full pace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError
from . import catalog
from .devices import Device, from_cluster_device
from .units import format_bytes, parse_bytes

FORMS = ("NAME", "NAME:SPEED", "NAME@MEMORY", "NAME:SPEED@MEMORY", "COUNTxNAME")
EXAMPLE = "a100-80g,rtx3090  or  a100-80g:1.0,rtx3090:0.67@1GiB"
MAX_DEVICES = 1024              # per item and in all: a spec is expanded device by device
SPEEDS = (0.01, 100.0)          # a slower device would sleep ~forever per step; a faster one is a typo
MEMORY = (1024, 1024**5)        # 1 KiB (tests use caps of a few KiB) to 1 PiB
_ITEM = re.compile(r"^(?:(?P<count>\d+)[x*])?(?P<name>[^:@]+?)(?::(?P<speed>[^@]*))?(?:@(?P<mem>.*))?$")


@dataclass(frozen=True, kw_only=True)
class ClusterDevice:
    """One device of a cluster spec; `speed` is the fraction of one CPU thread's pace it runs at."""

    index: int
    gpu: catalog.GpuSpec
    speed: float
    speed_source: str          # 'catalog speed index 0.67' or 'given in --emulate'
    memory_bytes: int
    memory_source: str         # 'catalog: 24 GiB card' or 'given cap'

    @property
    def label(self) -> str:
        return f"{self.gpu.key}#{self.index}"

    def to_device(self) -> Device:
        """This emulated device as a `devices.Device` record (kind 'emulated')."""
        return from_cluster_device(self)


def _bad(item: str, why: str) -> UsageError:
    return UsageError(
        f"bad device {item!r} in cluster spec: {why}" if item.strip() else why,
        f"write devices as {' | '.join(FORMS)}, comma separated, e.g. {EXAMPLE}",
    )


def device_items(spec: str) -> tuple[str, ...]:
    """The spec's items, one per device with its count expanded ('2xrtx3090@1GiB' gives
    'rtx3090@1GiB' twice): a node's part of a multi-node job's spec, joined with the other
    nodes' parts (runtime/ranks/nodes.py). The spec is checked first."""
    parse_cluster(spec)
    out: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        m = _ITEM.match(item)
        body = item[len(m["count"]) + 1:] if m["count"] else item
        out.extend([body] * int(m["count"] or 1))
    return tuple(out)


def parse_cluster(spec: str) -> tuple[ClusterDevice, ...]:
    """Parse a cluster spec; every problem is a UsageError naming the bad item and the forms."""
    if not spec or not spec.strip():
        raise _bad(spec, "the cluster spec is empty")
    raw: list[tuple[catalog.GpuSpec, float | None, int | None]] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise _bad(spec, "an empty item (two commas in a row, or a trailing comma)")
        m = _ITEM.match(item)
        if not m:
            raise _bad(item, "not of the accepted forms")
        try:
            gpu = catalog.resolve(m["name"].strip())
        except UsageError as e:
            raise _bad(item, e.what) from None
        speed = None
        if m["speed"] is not None:
            try:
                speed = float(m["speed"])
            except ValueError:
                raise _bad(item, f"speed {m['speed']!r} is not a number") from None
            if not SPEEDS[0] < speed <= SPEEDS[1]:     # also NaN and inf
                raise _bad(item, f"speed {m['speed']!r} must be a positive number in ({SPEEDS[0]:g}, {SPEEDS[1]:g}]")
        memory = None
        if m["mem"] is not None:
            try:
                memory = parse_bytes(m["mem"], what="memory")
            except UsageError as e:
                raise _bad(item, e.what) from None
            if not MEMORY[0] <= memory <= MEMORY[1]:
                raise _bad(item, f"memory {m['mem']!r} must be from 1KiB to 1PiB")
        # Checked before expanding (and before int() of a thousand digits): 1000000000xa100 is a typo.
        digits = (m["count"] or "1").lstrip("0") or "0"
        count = int(digits) if len(digits) <= len(str(MAX_DEVICES)) else MAX_DEVICES + 1
        if not 1 <= count <= MAX_DEVICES:
            raise _bad(item, f"the count must be from 1 to {MAX_DEVICES}")
        if len(raw) + count > MAX_DEVICES:
            raise _bad(item, f"a cluster spec names at most {MAX_DEVICES} devices in all")
        raw.extend([(gpu, speed, memory)] * count)

    speeds = [s if s is not None else gpu.speed_index for gpu, s, _ in raw]
    scale = max(1.0, max(speeds))
    return tuple(
        ClusterDevice(
            index=i, gpu=gpu, speed=speeds[i] / scale,
            speed_source=("given" if s is not None else f"catalog speed index {gpu.speed_index:g}"),
            memory_bytes=mem if mem is not None else gpu.memory_bytes,
            memory_source=("given cap" if mem is not None
                           else f"catalog: {format_bytes(gpu.memory_bytes)} card"),
        )
        for i, (gpu, s, mem) in enumerate(raw)
    )
