"""The pure memory model the planner calls: state per sharding, capacity fractions, partitions,
and the sharding choice on an 80 GB + 24 GB pair."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetrain.errors import UsageError
from hetrain.planning.cost import fixed_bytes
from hetrain.planning.memory import (ADAMW_STATE_FACTOR, DeviceMemory, capacity_fractions, choose_sharding,
                                     partition_bounds, sharding_options, state_bytes, state_factor)

GB = 1e9


def test_state_bytes_per_sharding():
    p = 1_000_000
    none = state_bytes(p, optimizer="adamw")
    assert (none.params, none.grads, none.optimizer) == (4e6, 4e6, 8e6) and none.total == 16e6
    z = state_bytes(p, sharding="zero1", world_size=4)
    assert (z.params, z.grads, z.optimizer) == (4e6, 4e6, 2e6)
    c = state_bytes(p, sharding="capacity", world_size=2, fraction=0.75)
    assert c.optimizer == 6e6 and c.params == 4e6
    f = state_bytes(p, sharding="fsdp", world_size=4, unit_params=[100_000, 200_000], root_params=50_000)
    assert (f.params, f.grads, f.optimizer) == (1e6, 1e6, 2e6)
    assert f.transient == (50_000 + 2 * 200_000) * 4
    acc = state_bytes(p, sharding="fsdp", world_size=4, accumulates=True)
    assert acc.params + acc.grads + acc.transient == 8e6      # whole params and grads during the step
    assert state_bytes(p, sharding="zero1", world_size=1).optimizer == 8e6   # one device: nothing shards
    assert state_bytes(p, optimizer="sgd").optimizer == 0
    assert state_bytes(p, optimizer="sgd-momentum", param_bytes=2, state_bytes_per_value=4).params == 2e6
    with pytest.raises(UsageError):
        state_bytes(p, sharding="zero3")
    with pytest.raises(UsageError):
        state_bytes(p, optimizer="lion")


def test_capacity_fractions_follow_free_memory():
    assert capacity_fractions([80, 24]) == pytest.approx((80 / 104, 24 / 104))
    assert capacity_fractions([10, -5, 30]) == (0.25, 0.0, 0.75)     # no room: no state
    with pytest.raises(UsageError):
        capacity_fractions([0, -1])


@given(st.integers(0, 10_000), st.lists(st.floats(0.01, 100), min_size=1, max_size=6))
def test_partition_bounds_cover_everything_in_proportion(n, fractions):
    b = partition_bounds(n, fractions)
    assert b[0] == 0 and b[-1] == n and len(b) == len(fractions) + 1
    sizes = [b[i + 1] - b[i] for i in range(len(fractions))]
    assert all(s >= 0 for s in sizes)
    total = sum(fractions)
    assert all(abs(s - n * f / total) < 1 for s, f in zip(sizes, fractions))


def pair(act=2 * GB):
    return [DeviceMemory(label="a100-80g", capacity=80 * GB, activations=act),
            DeviceMemory(label="rtx3090", capacity=24 * GB, activations=act)]


def test_choose_sharding_on_an_80_24_pair():
    devices = pair()
    # 1B parameters, AdamW fp32: 16 GB of state. Fits the 24 GB card whole.
    opt, why = choose_sharding(sharding_options(1_000_000_000, devices), devices)
    assert opt.strategy == "none" and "fit" in why
    # 1.5B: 24 GB unsharded, 18 GB + 2 GB with an even ZeRO-1 split: zero1
    opt, _ = choose_sharding(sharding_options(1_500_000_000, devices), devices)
    assert opt.strategy == "zero1"
    # 2B: even ZeRO-1 puts 8+8+8+2 = 26 GB on the 3090; the capacity split gives it the state in
    # proportion to what is free after parameters, gradients and activations: 6 of 62 + 6 GB
    options = {o.strategy: o for o in sharding_options(2_000_000_000, devices)}
    assert not options["zero1"].fits(devices) and options["capacity"].fits(devices)
    opt, why = choose_sharding(list(options.values()), devices)
    assert opt.strategy == "capacity" and "rtx3090" in why
    assert opt.state[1].optimizer == pytest.approx(16 * GB * 6 / 68)
    assert opt.peak[1] <= 24 * GB < options["zero1"].peak[1]
    # 3B: parameters and gradients alone (24 GB) fill the 3090: nothing that keeps them whole fits,
    # and even FSDP (24 GB of state per device on two) does not
    with pytest.raises(UsageError, match="does not fit"):
        choose_sharding(sharding_options(3_000_000_000, devices), devices)


def test_fsdp_when_only_sharding_parameters_fits():
    four = [DeviceMemory(label=f"rtx3090#{i}", capacity=24 * GB, activations=2 * GB) for i in range(4)]
    opt, why = choose_sharding(sharding_options(3_000_000_000, four), four)   # 48 GB of state / 4
    assert opt.strategy == "fsdp" and "zero1" in why and "capacity" in why
    assert all(p == pytest.approx(14 * GB) for p in opt.peak)


def test_the_catalog_estimate_and_pipeline_stages_use_this_model_state():
    # parameters + gradients + optimizer values, fp32: AdamW 4 + 4 + 8, SGD with momentum 4 + 4 + 4
    assert fixed_bytes(1_000_000, "adamw") == 16_000_000
    assert fixed_bytes(1_000_000, "sgd-momentum") == 12_000_000 and fixed_bytes(1_000_000, "sgd") == 8_000_000
    assert ADAMW_STATE_FACTOR == 4.0 == state_factor("adam")
    assert state_factor("sgd") == 2.0
    assert state_factor("adamw", param_bytes=2) == 6.0      # bf16 parameters and gradients, fp32 moments


def test_capacity_full_splits_parameters_gradients_and_state_by_the_fraction():
    """1000 fp32 parameters (root 200, two blocks of 400), AdamW, a quarter on this device: a quarter
    of each kind, plus the root and two blocks gathered, each with its flat gradient."""
    s = state_bytes(1000, sharding="capacity-full", world_size=2, fraction=0.25, unit_params=[400, 400],
                    root_params=200)
    assert (s.params, s.grads, s.optimizer) == (1000.0, 1000.0, 2000.0)
    assert s.transient == 2 * (200 + 2 * 400) * 4
    acc = state_bytes(1000, sharding="capacity-full", world_size=2, fraction=0.25, unit_params=[400, 400],
                      root_params=200, accumulates=True)
    assert acc.transient == 2 * 1000 * 4          # everything gathered, with its whole gradient
    assert "capacity-full" not in {o.strategy for o in sharding_options(1000, pair())}   # asked for by name only
