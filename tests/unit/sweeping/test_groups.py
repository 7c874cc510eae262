"""Which group of devices holds a trial too big for one: the planner's memory model
(sharding_options / choose_sharding) over the members, the fewest devices, the big card kept
free when small ones suffice; a need no group holds said with the largest group's room."""

from __future__ import annotations

from hetrain.planning.memory import DeviceMemory, choose_sharding, sharding_options
from hetrain.sweeping.groups import best_group, fits_no_group, group_fit
from hetrain.sweeping.placement import Need, Slot, need_of

GiB = 2**30
A100 = Slot(index=0, label="a100", memory_bytes=80 * GiB, speed=1.0)
R1 = Slot(index=1, label="3090#1", memory_bytes=24 * GiB, speed=0.67)
R2 = Slot(index=2, label="3090#2", memory_bytes=24 * GiB, speed=0.67)


def big(params=1_800_000_000):
    return need_of({"params": params, "batch": 32, "activation_bytes_per_sample": 100 * 2**20}, where="memory()")


def test_the_groups_sharding_is_the_planners_choice_for_its_members():
    need = big()
    fit = group_fit(need, (R1, R2))
    devices = [DeviceMemory(label=s.label, capacity=s.room, activations=16 * 100 * 2**20) for s in (R1, R2)]
    option, _ = choose_sharding(sharding_options(1_800_000_000, devices), devices)
    assert fit is not None and fit.sharding == option.strategy == "fsdp" and fit.peaks == option.peak


def test_two_small_cards_are_chosen_over_the_big_one_and_none_alone():
    need = big()
    assert need.bytes > R1.room and need.bytes <= A100.room
    assert group_fit(need, (R1,)) is None                     # a group is two devices or more
    assert best_group(need, (A100, R1, R2)).members == (R1, R2)
    assert best_group(need, (R1,)) is None


def test_a_need_given_as_bytes_is_never_split():
    assert group_fit(Need(bytes=30 * GiB, how="given"), (R1, R2)) is None
    assert "cannot split" in fits_no_group(Need(bytes=30 * GiB, how="given"), (R1, R2))


def test_a_need_no_group_holds_says_the_largest_groups_room():
    why = fits_no_group(big(30_000_000_000), (A100, R1, R2))
    assert best_group(big(30_000_000_000), (A100, R1, R2)) is None
    assert "the largest group, 3 device(s) (a100, 3090#1, 3090#2)" in why and "has room for 115.2 GiB" in why
    assert "under its best sharding, fsdp" in why
