"""Which trial a free device takes: bigger trials on bigger cards, never a trial a card cannot hold,
and one that fits no card reported with its need and the largest card's room."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.planning.memory import state_bytes
from hetrain.sweeping.placement import MARGIN, Need, Slot, assign, fits_somewhere, need_of

MiB = 2**20
BIG = Slot(index=0, label="a100", memory_bytes=80 * MiB, speed=1.0)
SMALL = Slot(index=1, label="3090", memory_bytes=24 * MiB, speed=0.67)
SLOTS = (BIG, SMALL)


def need(mib: float) -> Need:
    return Need(bytes=mib * MiB, how="given")


def test_the_need_is_the_planners_model_state_plus_the_batchs_activations():
    n = need_of({"params": 1_000_000, "batch": 8, "activation_bytes_per_sample": 1000}, where="memory()")
    assert n.bytes == state_bytes(1_000_000, optimizer="adamw").total + 8 * 1000
    lora = need_of({"params": 1_000_000, "trainable": 10_000, "batch": 8}, where="memory()")
    assert lora.bytes == state_bytes(1_000_000, optimizer="adamw", trainable=10_000).total < n.bytes
    assert need_of({"bytes": 123}, where="memory()").bytes == 123
    assert need_of(None, where="memory()").bytes == 0


@pytest.mark.parametrize("spec, words", [
    ([1, 2], "not a dict"), ({"batch": 3}, "no 'params'"), ({"params": 1, "widht": 3}, "unknown keys ['widht']"),
])
def test_a_bad_memory_answer_is_a_usage_error(spec, words):
    with pytest.raises(UsageError, match=words.replace("[", r"\[").replace("]", r"\]")):
        need_of(spec, where="memory()")


def test_both_free_the_big_card_takes_the_largest_and_the_small_card_the_smallest():
    queued = [(0, need(5)), (1, need(60)), (2, need(10))]
    got = dict((key, slot.label) for key, slot in assign(queued, SLOTS, SLOTS))
    assert got == {1: "a100", 0: "3090"}


def test_a_trial_that_only_the_big_card_holds_waits_for_it():
    queued = [(0, need(50)), (1, need(60))]           # neither fits 24 MiB less the margin
    assert assign(queued, [SMALL], SLOTS) == []       # the small card stays free rather than overflow
    assert [k for k, _ in assign(queued, [BIG], SLOTS)] == [1]


def test_a_free_small_card_takes_what_fits_it_and_leaves_the_big_trials():
    queued = [(0, need(50)), (1, need(3)), (2, need(20))]
    assert [(k, s.label) for k, s in assign(queued, [SMALL], SLOTS)] == [(1, "3090")]
    # the margin: 24 MiB less 10% holds 21.6 MiB, not 22
    assert assign([(0, need(22))], [SMALL], SLOTS) == [] and assign([(0, need(21))], [SMALL], SLOTS)


def test_a_trial_that_fits_no_card_says_its_need_and_the_largest_cards_room():
    assert fits_somewhere(need(70), SLOTS) is None
    why = fits_somewhere(need(90), SLOTS)
    assert "needs 90.0 MiB" in why and "a100" in why and f"{80 * (1 - MARGIN):.1f} MiB" in why
