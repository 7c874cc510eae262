"""Is every tensor handed to a torch.distributed collective on the job's collective device?

A CUDA job's NCCL group takes only CUDA tensors on the rank's device, and raises on a CPU one. On
CPU CI the job's device and the host are both 'cpu', so a tensor made by default (on the CPU) or
beside host-side state (an offloaded optimizer's) cannot be told from one made on the job's device:
the defect passes every gloo test (real gloo ranks cannot show it). So the job is made to declare
a device of its own: in `fake_world(device)` the code under test holds its parameters on `device`
(the tests use 'meta', a device distinct from the host whose tensors have shapes and dtypes but no
data, as the host cannot read a GPU's without a copy) and its host-side state on the CPU.
torch.distributed's collectives are replaced by recorders in a fake group of `world` ranks (they
move nothing), so the code's own device choices run through its collectives, and
`record.assert_on_device()` fails naming every collective that got a tensor elsewhere. Code that
reads a result's data after a collective (`.item()`) cannot on 'meta': `stop_after=n` raises
`CollectiveReached` after the n-th collective, once it is recorded. Modules call collectives as
`dist.<name>` (import torch.distributed as dist), which the patch reaches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

TENSOR_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
                      "all_to_all_single", "send", "recv", "isend", "irecv", "all_gather_single",
                      "reduce_scatter_single")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "barrier")


class CollectiveReached(Exception):
    """Raised by a fake world's n-th collective when asked to stop there (stop_after=n)."""


@dataclass
class Record:
    device: torch.device
    calls: list[tuple[str, list[torch.device]]] = field(default_factory=list)

    def violations(self) -> list[str]:
        return [f"dist.{name} got a tensor on {d}" for name, devices in self.calls for d in devices
                if d != self.device]

    def assert_on_device(self) -> None:
        bad = self.violations()
        assert not bad, f"collectives on tensors off the job's device {self.device}: " + "; ".join(bad)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _DoneWork:
    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def _patched(values: dict):
    saved = {name: getattr(dist, name) for name in values if hasattr(dist, name)}
    try:
        for name, value in values.items():
            setattr(dist, name, value)
        yield
    finally:
        for name in values:
            if name in saved:
                setattr(dist, name, saved[name])
            else:
                delattr(dist, name)


@contextlib.contextmanager
def fake_world(device: torch.device | str, *, rank: int = 0, world: int = 2, stop_after: int | None = None):
    """A fake group of `world` ranks seen from `rank`, whose collectives record their tensors'
    devices and move nothing; yields the Record."""
    record = Record(torch.device(device))

    def fake(name):
        def call(*args, async_op: bool = False, **kwargs):
            record.calls.append((name, [t.device for t in _tensors([*args, *kwargs.values()])]))
            if stop_after is not None and len(record.calls) >= stop_after:
                raise CollectiveReached(name)
            return _DoneWork() if async_op else None
        return call

    values = {n: fake(n) for n in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES}
    values.update(is_initialized=lambda: True, get_world_size=lambda group=None: world,
                  get_rank=lambda group=None: rank, get_global_rank=lambda group, r: r,
                  get_backend=lambda group=None: "nccl")
    with _patched(values):
        yield record
