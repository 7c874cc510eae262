"""The Trainer's evaluation split (hetrain.integrations.hf.evaluation.batch_ranges): every batch once,
in order, each rank a contiguous run sized by its share."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason='needs pip install "hetrain[hf]"')


@pytest.mark.parametrize("batches, shares, sizes", [
    (6, [10, 6], [4, 2]),           # 3.75 / 2.25: the larger remainder takes the odd batch
    (1, [10, 6], [1, 0]),           # fewer batches than ranks: a rank may run none
    (7, [1, 1, 1], [3, 2, 2]),
    (0, [3, 5], [0, 0]),
])
def test_each_rank_a_contiguous_run_of_batches_sized_by_its_share(batches, shares, sizes):
    from hetrain.integrations.hf.evaluation import batch_ranges

    ranges = batch_ranges(batches, shares)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(batches))
