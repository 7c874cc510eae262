"""A stream (a torch or `datasets` IterableDataset) read as the global-cursor sampler reads a
dataset (runtime/loop/sampler.py), so everything after it (shares, micro-batches, the sample log,
checkpoints) is the same for both.

The stream, in its own order, pass after pass, is the one global sample stream: global batch s
is its positions [s*B, (s+1)*B), and rank r takes its contiguous slice by its share in the current
Plan (StepSamples.for_rank). Every rank reads every sample of every global batch and keeps the
step's B samples (a stream cannot seek); the samples it trains on are only its slice, which it
collates and moves to its device. So a rank reads the whole stream, not 1/W of it: the price of
exact uneven slices. A library's own sharding (datasets.distributed.split_dataset_by_node) gives
each rank whole shards or every W-th sample, equal parts, not a share's contiguous slice, so it
is not used. The sampler's state is the stream position (pass, samples consumed in it); a resume
reopens the pass and reads past the consumed samples, which is exact for any stream that yields
the same samples in the same order each time it is read with the same set_epoch (datasets'
own state_dict is not: under .shuffle(buffer_size=) it counts the samples in the buffer as
consumed). The stream is read in this process: no DataLoader workers, so it is never duplicated.

End of a pass: the stream ran out. As drop_last says for a dataset: carry (default) takes the
rest of the step from the next pass; drop discards the tail shorter than a global batch.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import IterableDataset

from ...errors import HetrainError, UsageError
from ..resilience.store import gather_all
from .sampler import StepSamples

END = object()        # the stream's end, as next() returns it
FINGERPRINT = 4       # samples of the stream's head every rank compares


def is_stream(dataset) -> bool:
    """An IterableDataset (torch's, datasets', or anything iterable without indexing)."""
    return isinstance(dataset, IterableDataset) or (hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"))


def stream_length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:       # an IterableDataset without __len__ (datasets' streams among them)
        return None


class StreamSampler:
    """GlobalCursorSampler's interface (next_step, state_dict, epoch, cursor, step) over a stream;
    it also holds the samples it read: the current step's, and before the first step the stream's
    head, for what prepare() measures (StreamView serves both)."""

    def __init__(self, dataset, global_batch: int, *, length: int | None = None, drop_last: bool = False):
        if isinstance(dataset, Iterator):   # a generator, say: a second pass would be empty
            raise UsageError(f"the dataset is a {type(dataset).__name__}, an iterator: it can be read once only",
                             "pass an IterableDataset whose __iter__ starts the stream afresh "
                             "(datasets.IterableDataset.from_generator, or a class with __iter__)")
        self.dataset = dataset
        self.dataset_len = length        # samples in a pass, when the stream has a length
        self.global_batch = global_batch
        self.drop_last = drop_last
        self.epoch = 0                   # the pass
        self.cursor = 0                  # samples of this pass consumed
        self.step = 0
        self.reads = 0                   # samples this rank read from the stream (all of them, skipped ones too)
        self._it = None                  # the pass's iterator, at `cursor` (None: reopen and skip to it)
        self._items: dict[int, object] = {}   # the current step's samples by position
        self._head: list = []            # the stream's first samples, until the first step
        self._head_it = None
        self._started = False
        if length is not None and length < global_batch:
            raise _too_short(length, global_batch)

    @property
    def steps_per_epoch(self) -> float:
        if self.dataset_len is None:
            raise HetrainError("steps_per_epoch of a stream without a length", "this is a bug in hetrain; please report it")
        if self.drop_last:
            return float(self.dataset_len // self.global_batch)
        return self.dataset_len / self.global_batch

    # -- reading --------------------------------------------------------------------------------
    def _open(self, epoch: int):
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):          # datasets' .shuffle() reseeds its buffer by the epoch
            set_epoch(epoch)
        return iter(self.dataset)

    def _read(self):
        if self._it is None:
            self._it = self._open(self.epoch)
            skipped = sum(1 for _ in itertools.islice(self._it, self.cursor))   # a resume: past the consumed samples
            self.reads += skipped
            if skipped < self.cursor:
                raise UsageError(f"the stream ended after {skipped} samples of pass {self.epoch}, before the "
                                 f"checkpoint's position {self.cursor}",
                                 "resume with the same stream, or start a new run with another Checkpoints(dir=...)")
        if self.dataset_len is not None and self.cursor == self.dataset_len:
            return END
        item = next(self._it, END)
        if item is not END:
            self.reads += 1
        elif self.dataset_len is not None:
            raise UsageError(f"the stream yielded {self.cursor} samples in pass {self.epoch} but its len() is "
                             f"{self.dataset_len}", "make the dataset's __len__ the number of samples a pass yields")
        return item

    def _end_pass(self, b: int) -> None:
        if self.cursor == 0:
            raise UsageError(f"the stream yielded no samples in pass {self.epoch}"
                             + (": it can be read once only" if self.epoch else ""),
                             "pass an IterableDataset with samples, whose __iter__ starts the stream afresh each time")
        if self.cursor < b:
            raise _too_short(self.cursor, b)
        self.epoch, self.cursor, self._it = self.epoch + 1, 0, None

    def next_step(self, global_batch: int | None = None) -> StepSamples:
        """Read the next global batch of the stream; its indices are positions in their pass."""
        b = self.global_batch if global_batch is None else global_batch
        if not self._started:            # training starts: what prepare() measured on is let go
            self._started, self._head, self._head_it = True, [], None
        if self.drop_last and self.dataset_len is not None and self.dataset_len - self.cursor < b:
            self.epoch, self.cursor, self._it = self.epoch + 1, 0, None    # the tail, not read
        items: dict[int, object] = {}
        indices: list[int] = []
        epochs: list[int] = []
        while len(indices) < b:
            item = self._read()
            if item is END:
                self._end_pass(b)
                if self.drop_last:       # a tail shorter than a global batch: dropped
                    items, indices, epochs = {}, [], []
                continue
            items[self.cursor] = item    # a step's positions are distinct: a pass holds >= b samples
            indices.append(self.cursor)
            epochs.append(self.epoch)
            self.cursor += 1
        if self.dataset_len is not None and self.cursor == self.dataset_len:
            self.epoch, self.cursor, self._it = self.epoch + 1, 0, None    # as the map-style sampler's state
        self._items = items
        out = StepSamples(step=self.step, epoch=epochs[0], indices=tuple(indices), epochs=tuple(epochs))
        self.step += 1
        return out

    def item(self, position: int):
        """The sample at this position: of the current step, or of the head before the first step."""
        if self._started:
            if position not in self._items:
                raise HetrainError(f"sample {position} is not in step {self.step - 1} of the stream",
                                   "this is a bug in hetrain; please report it")
            return self._items[position]
        while len(self._head) <= position:
            if self._head_it is None:
                self._head_it = self._open(0)
            item = next(self._head_it, END)
            if item is END:
                raise IndexError(f"position {position} is past the stream's end ({len(self._head)} samples)")
            self.reads += 1
            self._head.append(item)
        return self._head[position]

    def head_size(self, most: int) -> int:
        """Samples the head holds, read up to `most` (fewer: the stream is that short)."""
        try:
            self.item(most - 1)
        except IndexError:
            pass
        return len(self._head)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"stream": True, "epoch": self.epoch, "cursor": self.cursor, "step": self.step,
                "dataset_len": self.dataset_len, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("stream"):
            raise UsageError("the checkpoint was saved reading a map-style dataset, this run reads a stream "
                             "(an IterableDataset)", "resume with the same dataset, or start a new run elsewhere")
        for key in ("dataset_len", "drop_last"):
            if state[key] != getattr(self, key):
                raise UsageError(f"the saved stream has {key}={state[key]!r}, this run has {getattr(self, key)!r}",
                                 "resume with the same dataset and data settings, or start a new run")
        self.epoch, self.cursor, self.step = int(state["epoch"]), int(state["cursor"]), int(state["step"])
        self._it = None                  # the next read reopens the pass and skips to the cursor


class StreamView:
    """What prepare() and the layouts read as the dataset (job.dataset): samples by position.
    Its length is the stream's, or without one the head it measured on (at most a global batch):
    before training only probes read it, and they read the head."""

    def __init__(self, sampler: StreamSampler, length: int):
        self.sampler = sampler
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, position: int):
        return self.sampler.item(position)

    def __getitems__(self, positions) -> list:
        return [self.sampler.item(p) for p in positions]


def open_stream(cfg, dataset, log=None) -> tuple[StreamSampler, StreamView, int]:
    """The sampler, the dataset view and the run's step count for a stream. A collective on
    several ranks: every rank compares its stream's first samples with rank 0's."""
    length = stream_length(dataset)
    if length is None and cfg.max_steps is None:
        given = f"epochs={cfg.epochs}" if cfg.epochs is not None else "no max_steps"
        raise UsageError(f"{given} with an IterableDataset that has no length: its pass's steps cannot be counted",
                         "pass max_steps=N to hetrain.init (or give the dataset a __len__)")
    sampler = StreamSampler(dataset, cfg.global_batch, length=length, drop_last=cfg.drop_last)
    head = sampler.head_size(cfg.global_batch if length is None else min(FINGERPRINT, length))
    if length is None and head < cfg.global_batch:
        raise _too_short(head, cfg.global_batch)
    prints = gather_all(_fingerprint(sampler, min(FINGERPRINT, head)))
    if len(set(prints)) > 1:
        differ = ", ".join(str(r) for r, p in enumerate(prints) if p != prints[0])
        raise UsageError(f"the stream's first samples on rank {differ} differ from rank 0's: each rank must read "
                         "the whole stream in the same order (it is split per rank: split_dataset_by_node, or an "
                         "__iter__ that reads the rank)",
                         "pass the whole stream to every rank: hetrain gives each rank its slice of every step")
    steps = cfg.max_steps if cfg.max_steps is not None else math.ceil(
        (cfg.epochs or 1.0) * sampler.steps_per_epoch - 1e-9)
    if log is not None:
        log.info(f"data: a stream ({type(dataset).__name__}, "
                 + (f"{length} samples a pass" if length is not None else "no length") +
                 "), read in its own order by every rank, each keeping its slice of every step"
                 + ("; shuffle= does not apply to a stream: shuffle the stream itself" if cfg.shuffle else ""))
    return sampler, StreamView(sampler, length if length is not None else head), steps


def _fingerprint(sampler: StreamSampler, n: int) -> str:
    h = hashlib.sha256()
    for p in range(n):
        _digest(sampler.item(p), h)
    return h.hexdigest()


def _digest(obj, h) -> None:
    """The sample's values into the hash, not its pickle: the same tensor pickles differently by
    its storage (datasets' torch format views a larger buffer on one rank than on another)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for x in obj:
            _digest(x, h)
        h.update(b"]")
    else:             # numbers, strings, arrays: their text
        h.update(repr(obj).encode())


def _too_short(n: int, b: int) -> UsageError:
    return UsageError(f"the stream has {n} samples a pass, fewer than one global batch of {b}",
                      f"use a global batch of at most {n}, or a longer stream")
