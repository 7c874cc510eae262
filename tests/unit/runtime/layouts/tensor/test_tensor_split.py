"""Tensor parallelism split by speed in the layout ranking (planning/tensor_split.py): its step is
the slowest rank's part of the compute plus the even split's all-reduces, so on a mixed pair it
ranks above the even split (which runs at the slow card's pace), and on equal devices the two are
the same and the even split, simpler, is kept."""

from __future__ import annotations

import math
import re

import pytest

from hetrain.planning.chooser import Request
from hetrain.planning.collectives import allreduce_seconds
from hetrain.planning.ranking import TP_COMM_PER_ACTIVATION, ModelState, rank_layouts
from hetrain.planning.options import PlanOptions, ring_link
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.layouts.tensor.split import (
    speed_fractions,
    speed_tp_row,
    tp_compute_seconds,
    tp_micro_batch,
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
    row = speed_tp_row(profiles, opts)
    # computed here from the definition: every rank's part of 64 samples through the whole model
    parts = [f * 64 * p.per_sample_s for f, p in zip((1 / 1.6, 0.6 / 1.6), profiles)]
    assert parts[0] == pytest.approx(parts[1])                   # proportional: both finish together
    comm = allreduce_seconds(2, 64 * TP_COMM_PER_ACTIVATION * 20e6, ring_link(profiles, opts))
    assert row.fits and row.comm_s == pytest.approx(comm)
    assert 64 / row.samples_per_s == pytest.approx(max(parts) + comm)
    fixed = _profiles([1.0, 0.6])                                # 1 ms a micro-batch, whatever its size
    # a shard runs every layer of each micro-batch: its fixed part whole, its samples' part by fraction
    assert tp_compute_seconds(fixed, (0.5, 0.5), batch=64, n_micro=2)[1] == pytest.approx(2 * 0.001 + 0.5 * 64 * 0.01 / 0.6)


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
    # each holds its fraction of the state (16 bytes a parameter with AdamW), and at most the whole
    # model's activations (a shard saves the replicated layers' whole)
    assert speed.memory[0] - speed.memory[1] == pytest.approx((1 / 1.6 - 0.6 / 1.6) * 16 * P)
    assert speed.memory[1] == pytest.approx(0.6 / 1.6 * 16 * P + 20e6 * 64)
    assert "memory at most its part of the state and the whole model's activations" in speed.detail


def test_when_tp_is_best_the_split_by_speed_is_chosen_over_the_even_one():
    # 515 MiB usable per device: the whole state (763 MiB) fits neither, nor do the whole parameters
    # and gradients the shardings keep; TP's parts do (62% of it: 477 MiB), and there are no blocks to
    # cut pipelines between
    profiles = _profiles([1.0, 0.6], memory=int(6e8), act=1e6)
    state = ModelState(params=P, trainable=P)
    ranking = rank_layouts(profiles, state=state, options=PlanOptions(global_batch=64, grad_bytes=4 * P),
                           request=Request(oom_recovery=False))       # TP ends an attempt on OOM: allowed
    assert ranking.best is not None and ranking.best.family == "TP by speed", ranking.why
    assert "TP runs every device at the slowest one's speed" in ranking.why


def test_equal_devices_keep_the_even_split():
    ranking = rank_layouts(_profiles([1.0, 1.0], memory=int(6e8), act=1e6), state=ModelState(params=P, trainable=P),
                           options=PlanOptions(global_batch=64, grad_bytes=4 * P), request=Request(oom_recovery=False))
    even, speed = _row(ranking, "TP"), _row(ranking, "TP by speed")
    assert speed.samples_per_s == pytest.approx(even.samples_per_s)
    assert ranking.best.family == "TP"


def test_a_part_that_does_not_fit_says_which_device():
    row = speed_tp_row(_profiles([1.0, 0.6], memory=int(1e8)), PlanOptions(global_batch=64, grad_bytes=4 * P))
    assert not row.fits and "do not fit dev" in row.detail and math.isclose(row.samples_per_s, 0.0)


def test_a_measured_step_replaces_the_compute_and_all_reduce_model():
    """`hetrain plan` times a step of the split (runtime/layouts/tensor/probe.py): the row costs its
    micro-batches from it, scaled to their rows as the fastest profile scales (a + b·m), plus the
    optimizer step it timed and the agreement; the modelled compute and all-reduces are gone."""
    profiles = _profiles([1.0, 0.5])                    # a = 1 ms, b = 10 ms a sample at speed 1
    opts = PlanOptions(global_batch=64, grad_bytes=4 * P, agree_s=0.002)
    modelled = speed_tp_row(profiles, opts)
    timed = speed_tp_row(profiles, opts, measured={"fb_s": 0.5, "opt_s": 0.03, "micro_batch": 16})
    m = int(re.search(r"micro-batch (\d+)x(\d+)", timed.detail).group(1))
    n = int(re.search(r"micro-batch (\d+)x(\d+)", timed.detail).group(2))
    assert m * n >= 64
    per = 0.5 * (0.001 + 0.01 * math.ceil(64 / n)) / (0.001 + 0.01 * 16)
    assert 64 / timed.samples_per_s == pytest.approx(n * per + 0.03 + 0.002, rel=1e-12)
    assert "a step measured here" in timed.detail and "all-reduces" not in timed.detail
    assert timed.memory == modelled.memory and timed.samples_per_s != modelled.samples_per_s
    # nothing usable measured: the model stands
    assert speed_tp_row(profiles, opts, measured={"fb_s": 0.0, "opt_s": 0.0, "micro_batch": 16}) == modelled


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


def test_every_rank_runs_the_micro_batch_the_tightest_part_holds():
    """The ranks run in lockstep: the smallest cap, a cap being what fits beside the rank's part of
    the state with the whole model's activations a micro-batch (a bound); the user's cap, the
    global batch; 0 where not one sample fits."""
    GiB = 2**30
    profiles = [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.001, per_sample_s=0.01 / s,
                              fixed_bytes=8 * GiB, activation_bytes_per_sample=0.25 * GiB,
                              activation_fixed_bytes=0.5 * GiB, memory_bytes=mem)
                for i, (s, mem) in enumerate([(1.0, 20 * GiB), (0.5, 10 * GiB)])]
    fractions = (2 / 3, 1 / 3)
    # by hand: 18 GiB usable - 5.33 state - 0.5 -> 48 samples; 9 - 2.67 - 0.5 -> 23 samples
    caps = (int((18 - 16 / 3 - 0.5) / 0.25), int((9 - 8 / 3 - 0.5) / 0.25))
    assert caps == (48, 23)
    assert tp_micro_batch(profiles, fractions, global_batch=64, margin=0.1) == (23, caps)
    assert tp_micro_batch(profiles, fractions, global_batch=16, margin=0.1)[0] == 16
    assert tp_micro_batch(profiles, fractions, global_batch=64, margin=0.1, limit=8)[0] == 8
    row = speed_tp_row(profiles, PlanOptions(global_batch=64, grad_bytes=GiB, memory_margin=0.1))
    assert "micro-batch 23x3" in row.detail
    small = [DeviceProfile(**{**p.__dict__, "memory_bytes": 3 * GiB}) for p in profiles]
    assert tp_micro_batch(small, fractions, global_batch=64, margin=0.1)[0] == 0


def test_a_measured_step_sizes_each_rank_from_what_it_held():
    """With what the probe counted on each rank (its shards' state, the activations its forward
    saved at the probe's rows), the row's memory is that, the activations scaled to the row's
    micro-batch as the profile scales them (c + d·m)."""
    profiles = [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.001, per_sample_s=0.01 / s,
                              fixed_bytes=16 * P, activation_bytes_per_sample=20e6, activation_fixed_bytes=4e6)
                for i, s in enumerate([1.0, 0.5])]
    opts = PlanOptions(global_batch=32, grad_bytes=4 * P)
    held = [[5e8, 3.0e8], [3e8, 2.6e8]]                     # counted at 16 rows
    row = speed_tp_row(profiles, opts, measured={"fb_s": 0.5, "opt_s": 0.03, "micro_batch": 16, "memory": held})
    assert "micro-batch 32x1" in row.detail and "what each rank holds counted there" in row.detail
    scale = (4e6 + 20e6 * 32) / (4e6 + 20e6 * 16)
    assert row.memory == pytest.approx((5e8 + 3.0e8 * scale, 3e8 + 2.6e8 * scale))
    # a count from another world (or none) is not used: the bound stands
    odd = speed_tp_row(profiles, opts, measured={"fb_s": 0.5, "opt_s": 0.03, "micro_batch": 16, "memory": held[:1]})
    assert odd.memory == speed_tp_row(profiles, opts).memory
