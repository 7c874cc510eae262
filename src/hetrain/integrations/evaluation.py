"""Evaluation over uneven shares, shared by the integrations: every rank a contiguous run of the
evaluation batches, sized by its share of the training batch, so a faster device evaluates more
and every batch is evaluated once, exactly as one process batches it (the Trainer's evaluation
loop, hf/evaluation.py; Fabric's evaluation DataLoaders, fabric/evaluation.py). Torch-free."""

from __future__ import annotations


def batch_ranges(batches: int, shares) -> list[range]:
    """Contiguous runs of batch indices, one per rank, sized by the shares (largest remainder)."""
    shares = list(shares)
    total = sum(shares)
    exact = [batches * s / total for s in shares]
    counts = [int(e) for e in exact]
    for r in sorted(range(len(shares)), key=lambda r: counts[r] - exact[r])[:batches - sum(counts)]:
        counts[r] += 1
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]
