"""Global-cursor sampler: every sample exactly once per epoch, whatever the shares, world size
or resume point."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.planning.shares import proportional_shares
from hetrain.runtime.loop.sampler import GlobalCursorSampler


def take(sampler: GlobalCursorSampler, shares: tuple[int, ...]) -> list[tuple[int, int]]:
    """Run one step as W ranks with these shares would: (epoch, index) for every sample."""
    s = sampler.next_step()
    offsets = [sum(shares[:r]) for r in range(len(shares))]
    out = []
    for r in range(len(shares)):
        indices, epochs = s.for_rank(tuple(offsets), shares, r)     # what the step loop hands rank r
        out += list(zip(epochs, indices))
    return out


def random_shares(draw, batch):
    world = draw(st.integers(1, min(4, batch)))
    speeds = draw(st.lists(st.floats(0.1, 1.0), min_size=world, max_size=world))
    return proportional_shares(batch, speeds)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 60), batch=st.integers(1, 16), steps=st.integers(1, 40),
       seed=st.integers(0, 3))
def test_carry_every_sample_exactly_once_per_epoch_under_random_share_changes(data, n, batch, steps, seed):
    if batch > n:
        return
    sampler = GlobalCursorSampler(n, batch, seed=seed)
    seen = []
    for _ in range(steps):
        seen += take(sampler, random_shares(data.draw, batch))
    per_epoch = Counter(e for e, _ in seen)
    complete = [e for e in per_epoch if per_epoch[e] == n]
    for e in per_epoch:
        indices = [i for ee, i in seen if ee == e]
        assert len(set(indices)) == len(indices), f"a sample repeated in epoch {e}"
        if e in complete:
            assert sorted(indices) == list(range(n))
    assert len(seen) == steps * batch          # nothing dropped in carry mode


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(2, 60), batch=st.integers(1, 16), steps=st.integers(2, 40))
def test_resume_on_another_world_size_continues_the_same_stream(data, n, batch, steps):
    if batch > n:
        return
    reference = GlobalCursorSampler(n, batch, seed=7)
    expected = [reference.next_step().indices for _ in range(steps)]

    cut = data.draw(st.integers(1, steps - 1))
    first = GlobalCursorSampler(n, batch, seed=7)
    got = []
    for _ in range(cut):
        got.append(tuple(i for _, i in take(first, random_shares(data.draw, batch))))
    state = first.state_dict()

    resumed = GlobalCursorSampler(n, batch, seed=7)      # new process, maybe another world size
    resumed.load_state_dict(state)
    for _ in range(steps - cut):
        got.append(tuple(i for _, i in take(resumed, random_shares(data.draw, batch))))
    assert got == expected


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50), batch=st.integers(1, 12), steps=st.integers(1, 30))
def test_drop_last_skips_the_tail_and_never_repeats(n, batch, steps):
    if batch > n:
        return
    sampler = GlobalCursorSampler(n, batch, seed=1, drop_last=True)
    per_epoch: dict[int, list[int]] = {}
    for _ in range(steps):
        s = sampler.next_step()
        assert len(set(s.epochs)) == 1              # a step never straddles epochs
        per_epoch.setdefault(s.epoch, []).extend(s.indices)
    for e, idx in per_epoch.items():
        assert len(idx) == len(set(idx))
        assert len(idx) <= (n // batch) * batch
    assert sampler.steps_per_epoch == n // batch


def test_epochs_are_different_permutations_and_seeded():
    a = GlobalCursorSampler(100, 10, seed=3)
    b = GlobalCursorSampler(100, 10, seed=3)
    assert a.permutation(0) == b.permutation(0)
    assert a.permutation(0) != a.permutation(1)
    assert GlobalCursorSampler(100, 10, seed=4).permutation(0) != a.permutation(0)


def test_a_step_can_straddle_two_epochs_in_carry_mode():
    s = GlobalCursorSampler(10, 4, seed=0)
    steps = [s.next_step() for _ in range(3)]
    assert steps[2].epochs == (0, 0, 1, 1)
    assert steps[2].epoch == 0
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["cursor"] == 2


def test_dataset_smaller_than_one_global_batch_is_a_usage_error():
    with pytest.raises(UsageError, match="fewer than one global batch") as e:
        GlobalCursorSampler(5, 8)
    assert "at most 5" in e.value.fix


def test_resume_with_another_dataset_is_refused():
    state = GlobalCursorSampler(100, 10).state_dict()
    with pytest.raises(UsageError, match="dataset_len"):
        GlobalCursorSampler(90, 10).load_state_dict(state)
