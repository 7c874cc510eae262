"""What an out-of-memory error leaves held on an emulated device, until the failed graph goes.

On a GPU, an OOM strikes when the device is full, and the failed forward or backward still holds
its graph's saved tensors: through the exception's traceback, the loss, the outputs. Memory comes
back only when the last of those references goes; a recovery that allocates before that (zeros to
complete a gradient sync, say) runs out of memory a second time, with its peers waiting in a
collective. The emulated meter reproduces it:

  * A counted forward's saved tensors are held by the graph through a `Saved` wrapper (the
    saved-tensor hooks' packed object), so the ledger learns the moment the graph lets go of each
    storage: after its backward node ran, or when the graph itself is freed.
  * An OOM (injected, or the meter's cap) marks every storage held then as the failed graph's.
  * `allocating()` meters what a recovery allocates (every new storage an op returns, on a
    dispatch mode): while any of the failed graph is held the device is full, and the first
    allocation raises the OOM a GPU would. Its `peak` is the most the recovery held at once.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..hardware.units import format_bytes


class Saved:
    """A saved tensor as a graph holds it; the ledger hears when the graph lets go."""

    __slots__ = ("tensor", "ledger", "ptr")

    def __init__(self, tensor: torch.Tensor, ledger: Ledger, ptr: int):
        # Detached: a saved output's own tensor would point back to the node that saves it, a cycle
        # through C++ that no collector sees, and an unexecuted node would never be freed.
        self.tensor, self.ledger, self.ptr = tensor.detach(), ledger, ptr

    def __del__(self):
        self.ledger.drop(self.ptr)


class Ledger:
    """Storages the graphs in flight hold (data pointer: [bytes, holders]), and after an OOM the
    failed graph's (data pointer: bytes) until each is released."""

    def __init__(self, label: str):
        self.label = label
        self.live: dict[int, list[int]] = {}
        self.failed: dict[int, int] = {}
        self.recovery_peak = 0          # the most the last metered recovery held at once

    def hold(self, tensor: torch.Tensor, ptr: int, nbytes: int) -> Saved:
        entry = self.live.setdefault(ptr, [nbytes, 0])
        entry[1] += 1
        return Saved(tensor, self, ptr)

    def drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.live[ptr]
            self.failed.pop(ptr, None)

    def out_of_memory(self) -> None:
        """An OOM strikes now: what the graphs hold is the failed graph's until released."""
        self.failed = {ptr: entry[0] for ptr, entry in self.live.items()}

    @property
    def held_bytes(self) -> int:
        """Bytes the failed graph still holds (0: released, or no OOM)."""
        return sum(self.failed.values())

    @contextmanager
    def allocating(self):
        """Meter what runs inside: a new storage while the failed graph is held raises the OOM."""
        mode = _Allocations(self)
        with mode:
            yield mode
        self.recovery_peak = mode.peak


class _Allocations(TorchDispatchMode):
    """Every new storage an op returns, held until freed (a storage finalizer); over the device's
    room (none while the failed graph is held) it is an out-of-memory error."""

    def __init__(self, ledger: Ledger):
        super().__init__()
        self.ledger = ledger
        self.live: dict[int, int] = {}
        self.held = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if not t.is_meta}
        for t in _tensors(out):
            if t.is_meta:
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self.live:
                continue
            self.live[ptr] = nbytes
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            weakref.finalize(storage, self._freed, ptr)
            held = self.ledger.held_bytes
            if held:
                raise torch.OutOfMemoryError(
                    f"{self.ledger.label}: out of memory (emulated): the recovery allocated "
                    f"{format_bytes(nbytes)} ({func}) while the failed graph still holds {format_bytes(held)}: "
                    "release it first")
        return out

    def _freed(self, ptr: int) -> None:
        self.held -= self.live.pop(ptr, 0)


def _tensors(x):
    """The tensors in an op's arguments or result (nested tuples, lists, dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
