from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.hardware.cluster import parse_cluster
from hetrain.hardware.units import format_bytes, parse_bytes


def test_catalog_speeds_relative_to_the_fastest():
    a, b = parse_cluster("a100-80g,rtx3090")
    assert a.speed == 1.0 and b.speed == pytest.approx(0.67)
    assert "catalog" in b.speed_source and b.memory_bytes == 24 * 1024**3


def test_given_speed_and_memory_cap():
    a, b = parse_cluster("a100-80g:1.0, rtx3090:0.5@1GiB")
    assert b.speed == 0.5 and b.memory_bytes == 1024**3 and b.memory_source == "given cap"


def test_counts_and_driver_names():
    devices = parse_cluster("2x3090,NVIDIA A100-SXM4-80GB")
    assert [d.gpu.key for d in devices] == ["rtx3090", "rtx3090", "a100-80g"]
    assert [d.index for d in devices] == [0, 1, 2]


@pytest.mark.parametrize("spec, words", [
    ("", "empty"),
    ("a100,,3090", "empty item"),
    ("a100:fast", "not a number"),
    ("a100:-1", "positive"),
    ("a100:0", "positive"),
    ("a100@2zz", "cannot read memory"),
    ("a100@0GiB", "zero"),
    ("rtx309", "did you mean"),
    ("a100:nan", "positive"),
    ("a100:inf", "positive"),
    ("a100:0.005", "(0.01, 100]"),
    ("a100:101", "(0.01, 100]"),
    ("a100@512", "from 1KiB to 1PiB"),
    ("1000000000xa100-80g", "from 1 to 1024"),          # was: expanded device by device, memory exhausted
    ("9" * 5000 + "xa100", "from 1 to 1024"),           # was: int() of 5000 digits, a ValueError
    ("0xa100", "from 1 to 1024"),
    ("1000xa100,30xrtx3090", "at most 1024 devices"),
])
def test_malformed_specs_name_the_bad_part_and_the_forms(spec, words):
    with pytest.raises(UsageError) as e:
        parse_cluster(spec)
    assert words in e.value.what
    assert "NAME:SPEED@MEMORY" in e.value.fix


def test_bounds_are_inclusive_where_they_say():
    assert len(parse_cluster("1024xa100")) == 1024
    (fast,) = parse_cluster("a100:100@1KiB")
    assert fast.speed == 1.0 and fast.memory_bytes == 1024     # rescaled: the fastest runs at full pace
    assert parse_cluster("a100:0.011,a100:1")[0].speed == pytest.approx(0.011)


def test_units():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes("1.5g") == int(1.5 * 1024**3)
    assert format_bytes(1536 * 1024**2) == "1.5 GiB"
    with pytest.raises(UsageError):
        parse_bytes("lots")


def test_one_cpu_thread_plays_an_a100_unless_a_faster_device_is_present():
    (alone,) = parse_cluster("rtx3090")
    assert alone.speed == pytest.approx(0.67)           # a 3090 alone still runs at its own pace
    h100, a100 = parse_cluster("h100-sxm,a100-80g")
    assert h100.speed == 1.0 and a100.speed == pytest.approx(1 / h100.gpu.speed_index)
