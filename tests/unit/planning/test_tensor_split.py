"""Tensor parallelism split by speed in the layout ranking (planning/tensor_split.py): its step is
the slowest rank's part of the compute plus the even split's all-reduces, so on a mixed pair it
ranks above the even split (which runs at the slow card's pace), and on equal devices the two are
the same and the even split, simpler, is kept."""

from __future__ import annotations

import math
import re

import pytest

from hetrain.planning.collectives import allreduce_seconds
from hetrain.planning.layouts import TP_COMM_PER_ACTIVATION, ModelState, rank_layouts
from hetrain.planning.options import PlanOptions, ring_link
from hetrain.planning.profile import DeviceProfile
from hetrain.planning.tensor_split import (
    speed_fractions,
    speed_tp_row,
    tp_compute_seconds,
)

P = 50_000_000


def _profiles(speeds, memory=None, act=20e6, overhead=0.001):
    return [DeviceProfile(device=f"dev{i}", source="given", overhead_s=overhead, per_sample_s=0.01 / s,
                          fixed_bytes=16 * P, activation_bytes_per_sample=act, memory_bytes=memory)
            for i, s in enumerate(speeds)]


def _row(ranking, family):
    return next(r for r in ranking.rows if r.family == family)


def test_fractions_follow_speed_and_round_to_whole_heads():
    assert speed_fractions([0.01, 0.01 / 0.6]) == pytest.approx((1 / 1.6, 0.6 / 1.6))
    assert speed_fractions([0.01, 0.01 / 0.6], units=8) == (5 / 8, 3 / 8)       # 8 heads -> 5/3
    assert speed_fractions([0.01, 0.01 / 0.6], units=4) == (3 / 4, 1 / 4)       # 4 key/value groups -> 3/1


def test_the_step_is_the_slowest_part_plus_the_even_splits_all_reduces():
    profiles = _profiles([1.0, 0.6], overhead=0.0)
    opts = PlanOptions(global_batch=64, grad_bytes=4 * P)
    row = speed_tp_row(profiles, ModelState(params=P, trainable=P), opts)
    # computed here from the definition: every rank's part of 64 samples through the whole model
    parts = [f * 64 * p.per_sample_s for f, p in zip((1 / 1.6, 0.6 / 1.6), profiles)]
    assert parts[0] == pytest.approx(parts[1])                   # proportional: both finish together
    comm = allreduce_seconds(2, 64 * TP_COMM_PER_ACTIVATION * 20e6, ring_link(profiles, opts))
    assert row.fits and row.comm_s == pytest.approx(comm)
    assert 64 / row.samples_per_s == pytest.approx(max(parts) + comm)
    fixed = _profiles([1.0, 0.6])                                # 1 ms a micro-batch, whatever its size
    assert tp_compute_seconds(fixed, (0.5, 0.5), batch=64, n_micro=2)[1] == pytest.approx(0.5 * (2 * 0.001 + 64 * 0.01 / 0.6))


def test_split_by_speed_wins_over_the_even_split_on_a_mixed_pair_and_says_why():
    profiles = _profiles([1.0, 0.6])
    ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P, blocks=8),
                           options=PlanOptions(global_batch=64, grad_bytes=4 * P))
    even, speed = _row(ranking, "TP"), _row(ranking, "TP by speed")
    compute = {"even": 0.5 * (0.001 + 64 * 0.01 / 0.6), "speed": (0.001 + 64 * 0.01) / 1.6}
    comm = even.comm_s
    assert speed.comm_s == pytest.approx(comm)
    assert speed.samples_per_s / even.samples_per_s == pytest.approx((compute["even"] + comm) / (compute["speed"] + comm))
    assert ranking.rows.index(speed) < ranking.rows.index(even)
    assert speed.run == "ht.prepare(..., parallel=hetrain.TensorParallel(split='speed'))"
    # each holds its fraction of the state: 16 bytes a parameter with AdamW
    assert speed.memory[0] - speed.memory[1] == pytest.approx((1 / 1.6 - 0.6 / 1.6) * (16 * P + 20e6 * 64))


def test_when_tp_is_best_the_split_by_speed_is_chosen_over_the_even_one():
    # 515 MiB usable per device: the whole state (763 MiB) fits neither, nor do the whole parameters
    # and gradients the shardings keep; TP's parts do (62% of it: 477 MiB), and there are no blocks to
    # cut pipelines between
    profiles = _profiles([1.0, 0.6], memory=int(6e8), act=1e6)
    state = ModelState(params=P, trainable=P)
    ranking = rank_layouts(profiles, state=state, options=PlanOptions(global_batch=64, grad_bytes=4 * P))
    assert ranking.best is not None and ranking.best.family == "TP by speed", ranking.why
    assert "TP runs every device at the slowest one's speed" in ranking.why


def test_equal_devices_keep_the_even_split():
    ranking = rank_layouts(_profiles([1.0, 1.0], memory=int(6e8), act=1e6), state=ModelState(params=P, trainable=P),
                           options=PlanOptions(global_batch=64, grad_bytes=4 * P))
    even, speed = _row(ranking, "TP"), _row(ranking, "TP by speed")
    assert speed.samples_per_s == pytest.approx(even.samples_per_s)
    assert ranking.best.family == "TP"


def test_a_part_that_does_not_fit_says_which_device():
    row = speed_tp_row(_profiles([1.0, 0.6], memory=int(1e8)), ModelState(params=P, trainable=P),
                       PlanOptions(global_batch=64, grad_bytes=4 * P))
    assert not row.fits and "do not fit dev" in row.detail and math.isclose(row.samples_per_s, 0.0)


def test_a_measured_step_replaces_the_compute_and_all_reduce_model():
    """`hetrain plan` times a step of the split (runtime/measure/tp_probe.py): the row costs its
    micro-batches from it, scaled to their rows as the fastest profile scales (a + b·m), plus the
    optimizer step it timed and the agreement; the modelled compute and all-reduces are gone."""
    profiles = _profiles([1.0, 0.5])                    # a = 1 ms, b = 10 ms a sample at speed 1
    opts = PlanOptions(global_batch=64, grad_bytes=4 * P, agree_s=0.002)
    state = ModelState(params=P, trainable=P)
    modelled = speed_tp_row(profiles, state, opts)
    timed = speed_tp_row(profiles, state, opts, measured={"fb_s": 0.5, "opt_s": 0.03, "micro_batch": 16})
    m = int(re.search(r"micro-batch (\d+)x(\d+)", timed.detail).group(1))
    n = int(re.search(r"micro-batch (\d+)x(\d+)", timed.detail).group(2))
    assert m * n >= 64
    per = 0.5 * (0.001 + 0.01 * math.ceil(64 / n)) / (0.001 + 0.01 * 16)
    assert 64 / timed.samples_per_s == pytest.approx(n * per + 0.03 + 0.002, rel=1e-12)
    assert "a step measured here" in timed.detail and "all-reduces" not in timed.detail
    assert timed.memory == modelled.memory and timed.samples_per_s != modelled.samples_per_s
    # nothing usable measured: the model stands
    assert speed_tp_row(profiles, state, opts, measured={"fb_s": 0.0, "opt_s": 0.0, "micro_batch": 16}) == modelled


def test_with_a_timed_split_by_speed_the_even_row_says_it_is_modelled():
    profiles = _profiles([1.0, 0.5])
    opts = PlanOptions(global_batch=64, grad_bytes=4 * P)
    state = ModelState(params=P, trainable=P, blocks=8)
    timed = rank_layouts(profiles, state=state, options=opts,
                         tp_measured={"fb_s": 0.5, "opt_s": 0.03, "micro_batch": 16})
    plain = rank_layouts(profiles, state=state, options=opts)
    assert "modelled: only the split by speed was timed here" in _row(timed, "TP").detail
    assert "modelled" not in _row(plain, "TP").detail
    assert "a step measured here" in _row(timed, "TP by speed").detail
