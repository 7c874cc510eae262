"""Evaluation over uneven shares, shared by the integrations: every rank a contiguous run of the
evaluation batches, sized by its share of the training batch, so a faster device evaluates more
and every batch is evaluated once, exactly as one process batches it (the Trainer's evaluation
loop, hf/evaluation.py; Fabric's evaluation DataLoaders, fabric/data.py; Accelerate's
evaluation batches, accel/evaluation.py). Torch-free."""

from __future__ import annotations


def split(total: int, weights) -> list[int]:
    """`total` in proportion to `weights` (largest remainders; sums to total exactly)."""
    w = [float(x) for x in weights]
    raw = [total * x / sum(w) for x in w]
    sizes = [int(r) for r in raw]
    for i in sorted(range(len(w)), key=lambda i: raw[i] - sizes[i], reverse=True)[:total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def batch_ranges(batches: int, shares) -> list[range]:
    """Contiguous runs of batch indices, one per rank, sized by the shares (largest remainder)."""
    starts = [0]
    for c in split(batches, list(shares)):
        starts.append(starts[-1] + c)
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]
