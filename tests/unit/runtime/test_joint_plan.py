"""The runtime's planning step: the straggle estimate from the sync probe."""

from __future__ import annotations

import pytest
import torch

from hetrain.runtime.agree import Table
from hetrain.runtime.joint_plan import SYNC_RUNS, _straggle


def test_straggle_is_the_median_run_of_how_far_the_last_rank_trails_the_mean():
    keys = [f"compute_{k}" for k in range(SYNC_RUNS)]
    # Three ranks; rank 2 is last in every run, by a different amount each time: with the others
    # at 1 and rank 2 at v, it trails the mean (2 + v)/3 by 3v/(2 + v) − 1. v = 7/4 is 40%.
    last = [1.0, 1.25, 1.75, 2.5, 4.0]                       # the middle run, by how far it trails: 7/4
    rows = [[1.0] * SYNC_RUNS, [1.0] * SYNC_RUNS, last[:SYNC_RUNS]]
    table = Table(keys, torch.tensor(rows, dtype=torch.float64))
    assert _straggle(table) == pytest.approx(0.4)
    zeros = Table(keys, torch.zeros(3, SYNC_RUNS, dtype=torch.float64))     # not timed (a GPU)
    assert _straggle(zeros) == 0.0
