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


# -- optimizer-state offload -----------------------------------------------------------------------
def test_offload_moves_exactly_the_optimizer_state_to_the_host():
    from hetrain.planning.memory import state_bytes

    n = 1000
    plain = state_bytes(n)                                   # fp32 weights, gradients, AdamW's two moments
    # bf16 on the device: 2 + 2 bytes a parameter stay, the fp32 copy and its state (4 + 8) move
    off = state_bytes(n, offload=True, device_param_bytes=2)
    assert (off.params, off.grads, off.optimizer, off.host) == (2000, 2000, 0, 12000)
    assert plain.total - off.total == off.host               # moved, not lost
    # fp32: the device's weights are the fp32 copy; it loses exactly the optimizer state
    off32 = state_bytes(n, offload=True)
    assert plain.total - off32.total == plain.optimizer == 8000
    assert off32.host == 8000 + 4000                          # the host steps on its own parameter copy
    # sharded: each device offloads its own slice
    f = state_bytes(n, sharding="fsdp", world_size=4, offload=True, device_param_bytes=2, unit_params=(250,) * 4)
    assert (f.params, f.grads, f.optimizer, f.host) == (500, 500, 0, 3000)
    c = state_bytes(n, sharding="capacity-full", world_size=2, fraction=0.25, offload=True, device_param_bytes=2,
                    unit_params=(250,) * 4)
    assert (c.params, c.grads, c.host) == (500, 500, 3000)


def _state(**kw):
    from hetrain.planning.ranking import ModelState

    return ModelState(params=kw.pop("params", 1_000_000), trainable=kw.pop("trainable", 1_000_000),
                      device_param_bytes=2, blocks=10, **kw)


def _devices(*memories_mib, per_sample=0.01):
    return [DeviceProfile(device=f"d{i}", source="test", overhead_s=0.001, per_sample_s=per_sample,
                          optimizer_s=0.002, fixed_bytes=0, activation_bytes_per_sample=1 * MIB,
                          memory_bytes=m * MIB, checkpoint_fraction=0.2, gpu="rtx3090")
            for i, m in enumerate(memories_mib)]


def test_an_offloading_device_pays_the_host_link_and_the_host_step():
    from hetrain.hardware.links import PCIE_GBS
    from hetrain.planning.savers import HOST_MEMORY_GBS, with_state

    state = _state()
    o = PlanOptions(global_batch=8, host_memory_bytes=2**40)
    shaped = with_state(_devices(100, 100), state, "fsdp", o, frozenset(), frozenset({1}))
    assert shaped[0].optimizer_s == 0.002                    # not offloading: its own step
    moved = 1_000_000 * 2 / 2                                # its half of the gradients (and parameters), bf16
    host = 1_000_000 * 12 / 2                                # its half's fp32 copy and AdamW state
    link = PCIE_GBS[4]                                       # rtx3090: PCIe 4.0
    want = 2 * moved / (link * 1e9) + (2 * host + moved) / (HOST_MEMORY_GBS * 1e9)
    assert shaped[1].optimizer_s == pytest.approx(want)
    assert shaped[1].fixed_bytes < shaped[0].fixed_bytes


def _dp(profiles, state, **kw):
    from hetrain.planning.ranking import _dp_row

    return _dp_row(profiles, state, PlanOptions(global_batch=6, link=FREE_LINK, **kw), "none")


def test_offload_goes_to_the_smallest_card_first_and_only_as_far_as_needed():
    # plain DP of 1M parameters: 16 MB each unoffloaded, 4 MB offloaded (bf16), 1 MiB a sample
    state = _state()
    need_plain = 16e6 / MIB + 1.0                            # ≈ 16.3 MiB with one sample
    need_off = 4e6 / MIB + 1.0                               # ≈ 4.8 MiB
    assert need_off < 10.8 < need_plain < 27
    room = 2**40
    profiles = _devices(40, 12, 30)                          # usable 36, 10.8, 27: only d1 is short
    row = _dp(profiles, state, host_memory_bytes=room)
    assert row.fits and row.savers[1] == "optim on host" and "host" not in row.savers[0] + row.savers[2]
    assert all(m <= p.memory_bytes * 0.9 for m, p in zip(row.memory, profiles))
    assert need_off * MIB <= row.memory[1] < need_plain * MIB
    profiles = _devices(40, 12, 14)                          # usable 36, 10.8, 12.6: the two small ones
    row = _dp(profiles, state, host_memory_bytes=room)
    assert row.fits and [("host" in c) for c in row.savers] == [False, True, True]


def test_no_host_room_no_offload_and_the_row_says_why():
    state = _state()
    profiles = _devices(40, 12, 30)
    row = _dp(profiles, state, host_memory_bytes=1e6)        # 12 MB of state would not fit 0.9 MB
    assert not row.fits and "no host room" in row.detail and "host memory usable" in row.detail
    row = _dp(profiles, state, host_memory_bytes=2**40, offload="none")
    assert not row.fits and "host" not in row.detail
    every = _dp(profiles, state, host_memory_bytes=2**40, offload="all")
    assert every.fits and all("optim on host" in c for c in every.savers)


def test_share_limits_are_respected_and_optimal():
    import itertools

    from hetrain.planning.shares import StepTime, solve_shares

    times = [StepTime(per_sample=1.0), StepTime(per_sample=2.0, limit=2), StepTime(per_sample=3.0, limit=1)]
    for batch in range(3, 12):
        got = solve_shares(batch, times)
        assert sum(got) == batch and got[1] <= 2 and got[2] <= 1
        best = min(max(t.seconds(s) for t, s in zip(times, c))
                   for c in itertools.product(range(1, batch + 1), repeat=3) if sum(c) == batch)
        assert max(t.seconds(s) for t, s in zip(times, got)) == best
    assert solve_shares(5, [StepTime(per_sample=1.0, limit=2)] * 2) is None


def test_llama_8b_on_two_a100s_and_two_3090s_fits_sharded_and_the_best_is_the_fastest():
    from hetrain.hardware.cluster import parse_cluster_spec
    from hetrain.planning.presets import PRESETS
    from hetrain.planning.ranking import ModelState, rank_layouts
    from hetrain.planning.savers import DEFAULT_HOST_MEMORY_PER_NODE
    from hetrain.planning.simulate import cluster_profiles

    spec = PRESETS["llama-8b"]
    profiles = cluster_profiles(parse_cluster_spec("2xa100-80g,2xrtx3090").devices, spec, precision="bf16",
                                efficiency=0.4, ratios="spec", optimizer="adamw")
    o = PlanOptions(global_batch=256, grad_bytes=spec.params * 4, host_memory_bytes=DEFAULT_HOST_MEMORY_PER_NODE)
    ranking = rank_layouts(profiles, state=ModelState.from_spec(spec), options=o)
    fitting = [r for r in ranking.rows if r.fits]
    sharded = [r for r in fitting if r.family in ("FSDP2", "capacity-full")]
    assert sharded, [r.detail for r in ranking.rows]
    for r in fitting:
        assert all(m <= cap for m, cap in zip(r.memory, ranking.capacity)), r.name
    assert ranking.best is not None
    assert ranking.best.samples_per_s == max(r.samples_per_s for r in fitting)
    best = ranking.best
    assert any("optim on host" in c for c in best.savers[2:])          # the 3090s offload
    assert any(c.startswith("ckpt ") and "/32" in c for c in best.savers)
    # without the savers nothing fits, as before
    bare = rank_layouts(profiles, state=ModelState.from_spec(spec),
                        options=PlanOptions(global_batch=256, grad_bytes=spec.params * 4, offload="none"))
    assert bare.best is None


def test_capacity_full_is_judged_on_its_share_not_on_the_whole_model_state():
    from hetrain.hardware.cluster import parse_cluster_spec
    from hetrain.planning.presets import PRESETS
    from hetrain.planning.ranking import ModelState, _dp_row
    from hetrain.planning.simulate import cluster_profiles

    spec = PRESETS["llama-8b"]
    profiles = cluster_profiles(parse_cluster_spec("2xa100-80g,2xrtx3090").devices, spec, precision="bf16",
                                efficiency=0.4, ratios="spec", optimizer="adamw")
    state = ModelState.from_spec(spec)
    row = _dp_row(profiles, state, PlanOptions(global_batch=256, offload="none"), "capacity-full")
    whole = state.state("none", world_size=1).total
    assert not row.fits and "fits on no device" not in row.detail
    # what it names is one device's share (capacity-full splits the state), well under the whole
    held = float(row.detail.split("(")[1].split(" GiB model state")[0]) * 2**30
    assert held < whole / 2, row.detail


def _llama(cluster: str):
    from hetrain.hardware.cluster import parse_cluster_spec
    from hetrain.planning.presets import PRESETS
    from hetrain.planning.ranking import ModelState
    from hetrain.planning.simulate import cluster_profiles

    spec = PRESETS["llama-8b"]
    profiles = cluster_profiles(parse_cluster_spec(cluster).devices, spec, precision="bf16", efficiency=0.4,
                                ratios="spec", optimizer="adamw")
    return profiles, ModelState.from_spec(spec), spec


def test_a_gathered_rank_that_cannot_hold_whole_parameters_runs_its_share_as_one_micro_batch():
    from hetrain.planning.savers import dp_plan

    profiles, state, spec = _llama("2xa100-80g,2xrtx3090")
    o = PlanOptions(global_batch=256, grad_bytes=spec.params * 4, host_memory_bytes=2**40)
    for sharding in ("fsdp", "capacity-full"):
        plan, shaped, capped = dp_plan(profiles, state, o, sharding, frozenset(range(4)), gathered=True)
        assert capped == {2, 3}                                   # the 3090s
        for d in plan.devices:
            assert d.predicted_memory_bytes <= profiles[d.rank].memory_bytes * 0.9
            if d.rank in capped:
                assert d.n_micro == 1 and d.share > 1              # checkpointing made room for more than one
            # a rank that accumulates is planned with whole parameters (its fixed bytes say so)
            whole = state.state(sharding, world_size=4, accumulates=True, offload=True).transient
            assert (shaped[d.rank].fixed_bytes >= whole) == (d.n_micro > 1)


def test_the_global_batch_advice_with_offload_works():
    from hetrain.planning.ranking import rank_layouts

    profiles, state, spec = _llama("8xrtx3090")
    o = PlanOptions(global_batch=256, grad_bytes=spec.params * 4, host_memory_bytes=2**40)
    ranking = rank_layouts(profiles, state=state, options=o)
    assert ranking.best is None
    (line,) = [t for t in ranking.to_fit if t.startswith("FSDP2 fits with a global batch of at most")]
    assert line.endswith("its optimizer state on host")
    most = int(line.split("at most ")[1].split(" ")[0])
    followed = rank_layouts(profiles, state=state, options=PlanOptions(global_batch=most, grad_bytes=spec.params * 4,
                                                                        host_memory_bytes=2**40))
    assert followed.best is not None and followed.best.family == "FSDP2"
