"""Real text that ships with every Python: the standard library's pydoc topics (~465 KB of
English prose and code), as bytes for a byte-level language model (vocabulary 256)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def pydoc_bytes() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class ByteWindows(Dataset):
    """Sample i: bytes [i·stride, i·stride + seq_len) as input, shifted by one as target."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int | None = None):
        self.data = data
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.n = (len(data) - seq_len - 1) // self.stride + 1
        if self.n < 1:
            raise ValueError(f"text of {len(data)} bytes is shorter than one window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        chunk = self.data[s:s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self[i] for i in indices]


def split(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]
