"""prepare()'s heap: frozen while it measures, so the collections that free the probes' wrappers
skip the libraries' objects, and collected in full once at its end, as before training."""

from __future__ import annotations

import gc
import weakref

import pytest

from hetrain.runtime.setup import freeze_heap, hold_heap


class _Node:
    pass


def _cycle() -> _Node:
    """An object only a reference cycle keeps alive once dropped: the collector's to free."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


@pytest.fixture
def unfrozen_heap():
    """Each case starts from an unfrozen heap; a freeze this process had before is put back."""
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_frozen:
            gc.freeze()


def test_prepare_holds_the_heap_then_collects_it_in_full(unfrozen_heap):
    before = _cycle()
    dead_before = weakref.ref(before)
    held = hold_heap()
    assert held and gc.get_freeze_count() > 0
    del before                       # died during prepare, in a cycle, while held
    made = _cycle()
    dead_made = weakref.ref(made)
    del made
    gc.collect()                     # a probe's collection: what prepare made, not the held heap
    assert dead_made() is None
    assert dead_before() is not None
    freeze_heap(held)                # before training: every dead cycle is collected, the rest frozen
    assert dead_before() is None
    assert gc.get_freeze_count() > 0


def test_a_heap_frozen_before_prepare_is_left_frozen(unfrozen_heap):
    preloaded = _cycle()             # a fork server's preload, frozen there: never scanned again
    dead_preloaded = weakref.ref(preloaded)
    gc.freeze()
    del preloaded
    held = hold_heap()
    assert held is False
    freeze_heap(held)
    assert dead_preloaded() is not None
