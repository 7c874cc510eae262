"""Global-cursor sampler: which dataset samples each rank computes in each step.

The whole job reads ONE stream: epoch 0's seeded permutation of the dataset, then epoch 1's, and
so on. Step s consumes the next `global_batch` positions of that stream, and rank r takes a
contiguous slice of them whose length is its share in the current Plan. The sampler's state is
just the stream position (epoch, cursor), so it is independent of shares and of the world size:
shares may change at any step boundary, and a resume with another number of devices continues at
the same sample. Every rank computes the same stream (same seed), so no indices are exchanged.

End of an epoch (a documented choice, `drop_last`):
  * carry (default): a step that runs past the end of an epoch takes its remaining samples from
    the start of the next epoch's permutation. Nothing is dropped and every sample is used
    exactly once per epoch; a step can hold samples of two epochs.
  * drop: the tail of each epoch shorter than a global batch is skipped, as DataLoader's
    drop_last does; every step holds one epoch's samples, and the tail is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UsageError


@dataclass(frozen=True)
class StepSamples:
    """The global batch of one step: dataset indices in stream order, and their epochs."""

    step: int
    epoch: int                  # epoch of the step's first sample
    indices: tuple[int, ...]    # length = global batch
    epochs: tuple[int, ...]     # epoch of each index (differs only when a step straddles epochs)

    def for_rank(self, offsets: tuple[int, ...], shares: tuple[int, ...],
                 rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rank `rank`'s contiguous slice of the step, by the plan's shares: (indices, epochs)."""
        start, end = offsets[rank], offsets[rank] + shares[rank]
        return self.indices[start:end], self.epochs[start:end]


class GlobalCursorSampler:
    def __init__(self, dataset_len: int, global_batch: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        if dataset_len < 1:
            raise UsageError("the dataset is empty", "pass a dataset with at least one sample")
        if dataset_len < global_batch:
            raise UsageError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of {global_batch}",
                f"use a global batch of at most {dataset_len}, or a larger dataset",
            )
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0          # position within the current epoch's permutation
        self.step = 0            # steps consumed so far
        self._perm_epoch = -1
        self._perm: list[int] = []

    # -- the stream ---------------------------------------------------------------------------
    def permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.dataset_len, generator=g).tolist()
            else:
                self._perm = list(range(self.dataset_len))
            self._perm_epoch = epoch
        return self._perm

    @property
    def steps_per_epoch(self) -> float:
        if self.drop_last:
            return float(self.dataset_len // self.global_batch)
        return self.dataset_len / self.global_batch

    def next_step(self, global_batch: int | None = None) -> StepSamples:
        """Consume the next global batch of the stream (optionally of another size)."""
        b = self.global_batch if global_batch is None else global_batch
        if self.drop_last and self.dataset_len - self.cursor < b:
            self.epoch, self.cursor = self.epoch + 1, 0
        start_epoch = self.epoch
        indices: list[int] = []
        epochs: list[int] = []
        while len(indices) < b:
            perm = self.permutation(self.epoch)
            take = perm[self.cursor:self.cursor + (b - len(indices))]
            indices += take
            epochs += [self.epoch] * len(take)
            self.cursor += len(take)
            if self.cursor == self.dataset_len:
                self.epoch, self.cursor = self.epoch + 1, 0
        out = StepSamples(step=self.step, epoch=start_epoch, indices=tuple(indices), epochs=tuple(epochs))
        self.step += 1
        return out

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "step": self.step, "seed": self.seed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        if state.get("stream"):     # saved by runtime/loop/stream.py's StreamSampler
            raise UsageError("the checkpoint was saved reading a stream (an IterableDataset), this run reads a "
                             "map-style dataset", "resume with the same dataset, or start a new run elsewhere")
        for key in ("dataset_len", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise UsageError(
                    f"the saved sampler has {key}={state[key]!r}, this run has {getattr(self, key)!r}",
                    "resume with the same dataset and data settings, or start a new run",
                )
        self.epoch, self.cursor, self.step = int(state["epoch"]), int(state["cursor"]), int(state["step"])


