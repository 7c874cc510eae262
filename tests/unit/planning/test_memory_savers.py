"""Memory savers in the planner: activation checkpointing of k of N blocks, and optimizer-state
offload to host memory (planning/savers.py); each against a count made here by hand."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.planning.collectives import FREE_LINK
from hetrain.planning.memory import ActivationProfile, activation_bytes_per_sample
from hetrain.planning.planner import PlanOptions, make_plan
from hetrain.planning.profile import DeviceProfile

MIB = 1024**2


def _profile(name: str, *, memory: int | None, blocks: int | None = 10, fixed: int = 40 * MIB,
             per_sample: float = 0.01) -> DeviceProfile:
    return DeviceProfile(device=name, source="test", overhead_s=0.001, per_sample_s=per_sample, optimizer_s=0.002,
                         fixed_bytes=fixed, activation_bytes_per_sample=50 * MIB, activation_fixed_bytes=10 * MIB,
                         memory_bytes=memory, checkpoint_fraction=0.2, recompute_factor=4 / 3, blocks=blocks)


# -- k of N blocks -------------------------------------------------------------------------------
def test_exact_activations_with_the_first_k_blocks_checkpointed():
    a = ActivationProfile(outside=7.0, block_saved=17.0, block_input=1.0, blocks=4)
    none = 7 + 4 * 17
    every = 7 + 4 * 1 + 17
    assert activation_bytes_per_sample(a, checkpointing=False) == none
    assert activation_bytes_per_sample(a, checkpointing=True) == every
    assert activation_bytes_per_sample(a, checkpointing=True, blocks=4) == every
    assert activation_bytes_per_sample(a, checkpointing=True, blocks=0) == none
    for k in (1, 2, 3):
        got = activation_bytes_per_sample(a, checkpointing=True, blocks=k)
        assert got == 7 + k * 1 + (4 - k) * 17          # the last 4-k blocks keep their insides
        if k < 3:
            assert every < got < none
    # the last block is the first to run backward: checkpointing it too saves nothing (its
    # inside is recomputed at once), so k = N-1 already reaches every block's peak, less its input
    assert activation_bytes_per_sample(a, checkpointing=True, blocks=3) == every - 1


def test_profile_memory_and_time_with_k_blocks_lie_strictly_between_none_and_all():
    p = _profile("d", memory=None)
    act = 10 * MIB + 50 * MIB * 3
    none, every = p.memory_needed(3), p.memory_needed(3, checkpointing=True)
    assert none == 40 * MIB + act and every == pytest.approx(40 * MIB + act * 0.2)
    previous = none
    for k in range(1, 10):
        got = p.memory_needed(3, checkpointing=True, blocks=k)
        assert got == pytest.approx(40 * MIB + act * (1 - k / 10 * 0.8))
        assert every < got < previous
        previous = got
        t = p.micro_seconds(3, checkpointing=True, blocks=k)
        assert t == pytest.approx(0.031 * (1 + k / 10 / 3))
        assert p.micro_seconds(3) < t < p.micro_seconds(3, checkpointing=True)


def test_the_planner_checkpoints_the_fewest_blocks_that_fit_and_records_them():
    roomy = _profile("roomy", memory=None)
    for memory_mib in (70, 80, 95, 110, 120):        # tighter to looser
        tight = _profile("tight", memory=memory_mib * MIB)
        plan = make_plan([roomy, tight], PlanOptions(global_batch=16, link=FREE_LINK, memory_margin=0.0))
        d = plan.devices[1]
        usable = memory_mib * MIB
        # the reference: the first k (0..10) at which one sample fits, counted here
        fits = [k for k in range(11) if 40 * MIB + 60 * MIB * (1 - k / 10 * 0.8) <= usable]
        k = fits[0]
        if k == 0:
            assert not d.checkpointing and d.checkpoint_blocks is None
        else:
            assert d.checkpointing and d.checkpoint_blocks == (None if k == 10 else k)
            assert f"{k} of 10 blocks" in " ".join(d.reasons) or k == 10
        assert d.predicted_memory_bytes <= usable
        assert not plan.devices[0].checkpointing


def test_without_a_block_count_checkpointing_is_every_block():
    tight = _profile("tight", memory=70 * MIB, blocks=None)
    plan = make_plan([tight], PlanOptions(global_batch=4, memory_margin=0.0))
    assert plan.devices[0].checkpointing and plan.devices[0].checkpoint_blocks is None


def test_bad_block_count_is_a_usage_error():
    with pytest.raises(UsageError, match="blocks"):
        _profile("d", memory=None, blocks=0)
