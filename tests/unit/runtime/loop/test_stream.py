"""The stream reader (runtime/loop/stream.py): an IterableDataset read as the global-cursor
sampler reads a dataset without shuffling. Reference: the map-style sampler with shuffle=False,
and the stream itself read in one loop."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.planning.shares import proportional_shares
from hetrain.runtime.config import Config
from hetrain.runtime.loop.sampler import GlobalCursorSampler
from hetrain.runtime.loop.stream import StreamSampler, StreamView, is_stream, open_stream


class Stream(torch.utils.data.IterableDataset):
    """n samples a pass, in an order that depends on the pass (as datasets' shuffle with set_epoch):
    sample value = 1000 * id, so a position's sample is checkable."""

    def __init__(self, n: int, *, sized: bool = False, seed: int = 0):
        self.n, self.sized, self.seed, self.epoch, self.opened = n, sized, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        ids = list(range(self.n))
        random.Random(self.seed * 1000 + epoch).shuffle(ids)
        return ids

    def __iter__(self):
        self.opened += 1
        return iter([1000 * i for i in self.order(self.epoch)])

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return self.n


def step_as_ranks(sampler, shares):
    """One step as W ranks with these shares take it: [(epoch, position, sample)] in global order."""
    s = sampler.next_step()
    offsets = tuple(sum(shares[:r]) for r in range(len(shares)))
    out = []
    for r in range(len(shares)):
        indices, epochs = s.for_rank(offsets, shares, r)
        out += [(e, i, sampler.item(i)) for e, i in zip(epochs, indices)]
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), batch=st.integers(1, 12), steps=st.integers(1, 30),
       sized=st.booleans(), drop=st.booleans())
def test_the_same_steps_as_the_unshuffled_sampler_and_every_sample_once_a_pass(data, n, batch, steps, sized, drop):
    if batch > n:
        return
    ds = Stream(n, sized=sized, seed=n)
    stream = StreamSampler(ds, batch, length=n if sized else None, drop_last=drop)
    reference = GlobalCursorSampler(n, batch, shuffle=False, drop_last=drop)
    seen = []
    for _ in range(steps):
        world = data.draw(st.integers(1, min(4, batch)))
        shares = tuple(proportional_shares(batch, [data.draw(st.floats(0.1, 1.0)) for _ in range(world)]))
        want = reference.next_step()
        got = step_as_ranks(stream, shares)           # shares change at every step boundary
        assert [(e, i) for e, i, _ in got] == list(zip(want.epochs, want.indices))
        assert all(v == 1000 * ds.order(e)[i] for e, i, v in got)    # position i of pass e's order
        seen += got
    for e in {e for e, _, _ in seen}:
        ids = [v for ee, _, v in seen if ee == e]
        assert len(ids) == len(set(ids)), f"a sample twice in pass {e}"
    if not drop:
        assert len(seen) == steps * batch


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), batch=st.integers(1, 12), steps=st.integers(2, 30), sized=st.booleans(),
       drop=st.booleans(), data=st.data())
def test_resume_from_the_state_continues_the_same_stream(n, batch, steps, sized, drop, data):
    if batch > n:
        return
    length = n if sized else None
    whole = StreamSampler(Stream(n, sized=sized), batch, length=length, drop_last=drop)
    expected = [step_as_ranks(whole, (batch,)) for _ in range(steps)]
    cut = data.draw(st.integers(1, steps - 1))
    first = StreamSampler(Stream(n, sized=sized), batch, length=length, drop_last=drop)
    got = [step_as_ranks(first, (batch,)) for _ in range(cut)]
    resumed = StreamSampler(Stream(n, sized=sized), batch, length=length, drop_last=drop)   # a new process
    resumed.load_state_dict(first.state_dict())
    got += [step_as_ranks(resumed, (batch,)) for _ in range(steps - cut)]
    assert got == expected


def test_every_rank_reads_the_whole_stream_and_a_pass_is_opened_once():
    ds = Stream(10)
    s = StreamSampler(ds, 4)
    for _ in range(5):        # 20 samples: two passes
        s.next_step()
    assert s.reads == 20 and ds.opened == 2
    assert s.state_dict() == {"stream": True, "epoch": 1, "cursor": 10, "step": 5, "dataset_len": None,
                              "drop_last": False}


def test_the_view_serves_the_head_before_training_then_the_step():
    ds = Stream(10, sized=True)
    s = StreamSampler(ds, 4, length=10)
    view = StreamView(s, 10)
    assert view.__getitems__([0, 1]) == [1000 * i for i in ds.order(0)[:2]]   # what prepare() measures on
    step = s.next_step()
    assert view.__getitems__(list(step.indices[2:])) == [1000 * i for i in ds.order(0)[2:4]]
    with pytest.raises(Exception, match="not in step 0"):
        view[7]


def test_open_stream_counts_steps_from_a_length_and_refuses_epochs_without_one():
    sampler, view, steps = open_stream(Config(global_batch=4, epochs=2.0), Stream(10, sized=True))
    assert steps == 5 and len(view) == 10
    sampler, view, steps = open_stream(Config(global_batch=4, max_steps=7), Stream(10))
    assert steps == 7 and len(view) == 4                  # the head prepare() may measure on
    for cfg in (Config(global_batch=4, epochs=2.0), Config(global_batch=4)):
        with pytest.raises(UsageError) as e:
            open_stream(cfg, Stream(10))
        assert "no length" in e.value.what and "max_steps" in e.value.fix
        assert "\n" not in str(e.value)


def test_bad_streams_are_one_line_usage_errors():
    with pytest.raises(UsageError, match="fewer than one global batch"):
        open_stream(Config(global_batch=8, max_steps=1), Stream(5))
    with pytest.raises(UsageError, match="an iterator"):
        StreamSampler(iter(range(10)), 4)
    liar = StreamSampler(Stream(6), 4, length=10)         # len() says 10, a pass yields 6
    liar.next_step()
    with pytest.raises(UsageError, match="yielded 6 samples"):
        liar.next_step()
    once = StreamSampler(OnceOnly(), 4)
    for _ in range(2):
        once.next_step()
    with pytest.raises(UsageError, match="read once only"):
        once.next_step()


class OnceOnly(torch.utils.data.IterableDataset):
    def __init__(self):
        self.left = list(range(8))

    def __iter__(self):
        out, self.left = self.left, []
        return iter(out)


def test_a_checkpoint_of_the_other_kind_of_dataset_is_refused():
    stream = StreamSampler(Stream(10), 4)
    mapped = GlobalCursorSampler(10, 4)
    with pytest.raises(UsageError, match="map-style"):
        stream.load_state_dict(mapped.state_dict())
    with pytest.raises(UsageError, match="reading a stream"):
        mapped.load_state_dict(stream.state_dict())


def test_a_datasets_stream_from_a_generator_reshuffled_each_pass():
    datasets = pytest.importorskip("datasets")

    def gen():
        for i in range(12):
            yield {"id": i}

    ds = datasets.IterableDataset.from_generator(gen).shuffle(seed=3, buffer_size=5)
    assert is_stream(ds)
    sampler, view, steps = open_stream(Config(global_batch=5, max_steps=6), ds)
    passes: dict[int, list[int]] = {}
    for _ in range(steps):         # 30 samples: passes 0 and 1 whole, 6 of pass 2
        s = sampler.next_step()
        for e, i in zip(s.epochs, s.indices):
            passes.setdefault(e, []).append(view[i]["id"])
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(12))
    assert passes[0] != passes[1]                         # set_epoch reseeded the buffer
    ds.set_epoch(0)
    assert passes[0] == [x["id"] for x in ds]             # the stream's own order
