"""Every layout ranked (planning/ranking.py): each row agrees with the planner it is built on, the
memory of each sharding is the state it divides, and the advice for a model that fits nowhere
works when followed."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from hetrain.hardware.cluster import parse_cluster_spec
from hetrain.planning.collectives import Link
from hetrain.planning.ranking import ORDER, ModelState, rank_layouts
from hetrain.planning.options import PlanOptions
from hetrain.planning.planner import make_plan
from hetrain.planning.presets import fine_tuned, preset
from hetrain.planning.profile import DeviceProfile
from hetrain.planning.simulate import cluster_profiles

P = 50_000_000          # parameters of the hand-made model: 800 MB of AdamW state


def _profiles(speeds, memory=None, act=20e6):
    return [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.001, per_sample_s=0.01 / s,
                          fixed_bytes=16 * P, activation_bytes_per_sample=act, memory_bytes=memory)
            for i, s in enumerate(speeds)]


def _row(ranking, family):
    return next(r for r in ranking.rows if r.family == family)


def test_every_layout_is_ranked_and_dp_is_the_planners_prediction():
    profiles = _profiles([1.0, 1.0, 0.67, 0.67])
    opts = PlanOptions(global_batch=64, grad_bytes=4 * P)
    ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P, blocks=8), options=opts)
    assert {r.family for r in ranking.rows} == set(ORDER)
    reference = make_plan(profiles, opts).predicted["samples_per_s"]     # the planner alone
    assert _row(ranking, "DP").samples_per_s == pytest.approx(reference, rel=1e-9)
    rates = [r.samples_per_s for r in ranking.rows if r.fits and r is not ranking.best]
    assert rates == sorted(rates, reverse=True)
    assert ranking.best.samples_per_s >= 0.95 * max(r.samples_per_s for r in ranking.rows)


def test_sharded_memory_is_the_state_each_device_no_longer_holds():
    # Memory not capped: every sharding runs the same shares and micro-batches, so the peaks differ
    # by exactly the state each device drops: optimizer state (8 bytes/parameter) · (1 − 1/W).
    profiles = _profiles([1.0, 1.0, 0.5])
    opts = PlanOptions(global_batch=30, grad_bytes=4 * P)
    ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P), options=opts)
    dp, zero = _row(ranking, "DP"), _row(ranking, "DP + ZeRO-1")
    for whole, sharded in zip(dp.memory, zero.memory):
        assert whole - sharded == pytest.approx(8 * P * (1 - 1 / 3), rel=1e-6)
    assert zero.comm_bytes > dp.comm_bytes          # the parameters' all-gather after the step


def test_fsdp_on_a_rank_that_accumulates_holds_whole_parameters():
    # 16 MB/sample, 1.2 GB usable: fully sharded (267 MB) leaves room for ~58 samples at once,
    # whole parameters and gradients (400+200... MB) for fewer; a share of 100 must accumulate.
    profiles = _profiles([1.0, 1.0, 1.0], memory=int(1.5e9), act=16e6)
    state = ModelState(params=P, trainable=P, blocks=10)
    ranking = rank_layouts(profiles, state=state, options=PlanOptions(global_batch=300, grad_bytes=4 * P))
    fsdp = _row(ranking, "FSDP2")
    assert fsdp.fits and "accumulate" in fsdp.detail
    whole = state.state("fsdp", world_size=3, accumulates=True).total
    assert whole == pytest.approx(4 * P + 4 * P + 8 * P / 3)
    assert all(m >= whole for m in fsdp.memory)


def test_a_slow_link_makes_the_pipeline_win_and_says_why():
    profiles = _profiles([1.0, 1.0])
    slow = Link(bandwidth_gbs=0.01, source="given")
    ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P, blocks=8),
                           options=PlanOptions(global_batch=64, grad_bytes=4 * P, link=slow))
    assert ranking.best.family in ("PP", "TP")
    assert "communication" in ranking.why or "collectives" in ranking.why


def test_tensor_parallel_runs_at_the_slowest_devices_speed():
    profiles = _profiles([1.0, 0.25])
    ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P, blocks=8),
                           options=PlanOptions(global_batch=64, grad_bytes=4 * P))
    tp = _row(ranking, "TP")
    slowest_alone = 64 / (0.001 + 64 * 0.04)        # the slow device's rate on the whole batch
    assert tp.samples_per_s <= 2 * slowest_alone * 1.0001


def _catalog(spec, model, batch):
    profiles = cluster_profiles(parse_cluster_spec(spec).devices, model)
    opts = PlanOptions(global_batch=batch, grad_bytes=model.trainable * 4)
    return profiles, opts, rank_layouts(profiles, state=ModelState.from_spec(model), options=opts)


def test_llama_8b_fits_nowhere_and_the_advice_works():
    model = preset("llama-8b")
    profiles, opts, ranking = _catalog("a100-80g,rtx3090,rtx3090", model, 64)
    assert ranking.best is None and all(not r.fits for r in ranking.rows)
    devices_line = next(t for t in ranking.to_fit if t.startswith("FSDP2 fits on"))
    n = int(re.match(r"FSDP2 fits on (\d+) devices", devices_line).group(1))
    smallest = min(profiles, key=lambda p: p.memory_bytes)
    state = ModelState.from_spec(model)
    fsdp = lambda k: _row(rank_layouts([replace(smallest, device=f"d{i}") for i in range(k)], state=state,
                                       options=replace(opts, global_batch=k)), "FSDP2")
    assert fsdp(n).fits and not fsdp(n - 1).fits
    trainable_line = next(t for t in ranking.to_fit if t.startswith("DP fits when at most"))
    t = int(re.search(r"at most ([\d,]+)", trainable_line).group(1).replace(",", ""))
    tuned = lambda k: _row(rank_layouts(profiles, state=replace(state, trainable=k, frozen_param_bytes=2),
                                        options=replace(opts, grad_bytes=4 * k)), "DP")
    assert tuned(t).fits and not tuned(int(t * 1.2)).fits


def test_lora_on_the_seed_cluster_fits_and_counts_only_the_adapters():
    model = fine_tuned("llama-8b", lora_rank=16)
    _, _, ranking = _catalog("a100-80g,rtx3090,rtx3090,rtx3090", model, 64)
    assert ranking.best is not None
    dp = _row(ranking, "DP")
    assert dp.fits and dp.comm_bytes == pytest.approx(2 * 3 / 4 * 4 * model.trainable)
    assert math.isfinite(ranking.best.samples_per_s) and ranking.best.run


def test_a_pipelines_micro_batches_each_pay_the_profiles_fixed_cost():
    # Same devices, one with a fixed cost per micro-batch: 64 samples in 8 micro-batches of 8, so
    # every stage's micro-batch time (and the fill-drain step) grows by 1 + a / (b · 8).
    def pp(overhead):
        profiles = [replace(p, overhead_s=overhead) for p in _profiles([1.0, 0.5], act=1e3)]
        ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P, blocks=8),
                               options=PlanOptions(global_batch=64, grad_bytes=4 * P))
        return _row(ranking, "PP")

    free, fixed = pp(0.0), pp(0.04)
    assert free.name == fixed.name == "PP 2 stages"
    assert free.samples_per_s / fixed.samples_per_s == pytest.approx(1 + 0.04 / (0.01 * 8), rel=1e-9)


def test_dp_pp_fixed_cost_follows_the_smallest_replicas_micro_batch_and_spares_the_sync():
    from hetrain.planning.parallelism import with_fixed_cost
    from hetrain.planning.parallelism import Candidate

    c = Candidate(name="DP×PP 2×2", kind="dp×pp", fits=True, samples_per_s=32 / 0.5, detail="", replicas=2,
                  stages=2, shares=(19, 13), sync_s=0.1)
    fastest = _profiles([1.0], act=1e3)[0]            # a = 1 ms, b = 10 ms per sample
    out = with_fixed_cost(c, fastest, global_batch=32, micro_batches=8, schedule="1f1b")
    mu = 2                                             # ceil(13 / 8): the smaller replica's micro-batch
    assert 32 / out.samples_per_s == pytest.approx(0.4 * (1 + 0.001 / (0.01 * mu)) + 0.1, rel=1e-9)
    assert with_fixed_cost(replace(c, fits=False), fastest, global_batch=32, micro_batches=8,
                           schedule="1f1b") == replace(c, fits=False)


def test_measured_blocks_size_the_pipelines_rows_as_the_runtime_would():
    """`hetrain plan` hands the ranking the blocks the runtime measured (Measurements.pipeline):
    a heavy first block moves the split off the equal-blocks one, and the JSON round trip keeps it."""
    from hetrain.planning.ranking import measured_pipeline
    from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, split_pipeline

    heavy = PipelineProfile(blocks=(BlockCost(seconds=0.03, param_bytes=4e6, activation_bytes=1e6),)
                            + (BlockCost(seconds=0.01, param_bytes=4e6, activation_bytes=1e6),) * 3)
    data = {"profile": heavy.to_dict(), "devices": [{"name": f"dev{i}", "speed": 1.0, "memory_bytes": None}
                                                     for i in range(2)]}
    layer, devices = measured_pipeline(data)
    assert layer == heavy and [d.name for d in devices] == ["dev0", "dev1"]
    profiles = _profiles([1.0, 1.0])
    state = ModelState(params=P, trainable=P, blocks=4)
    opts = PlanOptions(global_batch=32, grad_bytes=4 * P)
    pp = lambda **kw: _row(rank_layouts(profiles, state=state, options=opts, **kw), "PP")
    assert "blocks per stage 2/2" in pp().detail                     # equal blocks: the middle
    want = split_pipeline(heavy, devices, micro_batches=8, micro_batch_size=4).sizes
    assert want == (1, 3) and "blocks per stage 1/3" in pp(pipeline=(layer, devices)).detail


def test_a_measured_stage_factor_replaces_the_whole_model_fixed_cost_stretch():
    """Blocks measured with how a stage runs them (stage_factor, runtime/layouts/pipeline/probe.py):
    each stage pays it in the split's own costing, so the row is that split's prediction, not
    stretched again by the whole model's fixed cost (with_fixed_cost); unmeasured (1), the stretch
    stays."""
    from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, StageDevice, split_pipeline

    blocks = (BlockCost(seconds=0.01, param_bytes=4e6, activation_bytes=1e6),) * 4
    devices = [StageDevice(name=f"dev{i}", speed=1.0) for i in range(2)]
    profiles = _profiles([1.0, 1.0])                   # a = 1 ms a micro-batch, b = 10 ms a sample
    state = ModelState(params=P, trainable=P, blocks=4)
    opts = PlanOptions(global_batch=32, grad_bytes=4 * P, link=Link(bandwidth_gbs=1e9, latency_s=0.0))
    pp = lambda prof: _row(rank_layouts(profiles, state=state, options=opts,      # noqa: E731
                                        pipeline=(prof, devices)), "PP")
    fixed = PipelineProfile(blocks=blocks, stage_factor=1.3)
    split = split_pipeline(fixed, devices, micro_batches=8, micro_batch_size=4)
    assert pp(fixed).samples_per_s == pytest.approx(split.samples_per_s, rel=1e-6)
    plain = PipelineProfile(blocks=blocks)
    bare = split_pipeline(plain, devices, micro_batches=8, micro_batch_size=4).samples_per_s
    assert pp(plain).samples_per_s == pytest.approx(bare / (1 + 0.001 / (0.01 * 4)), rel=1e-3)


def test_a_measured_fsdp_excess_replaces_the_modelled_collectives():
    # `hetrain plan` times an FSDP2 step beside a DDP step (runtime/measure/fsdp_probe.py): the
    # FSDP2 row is then DP's step (same shares, memory not capped) plus that measured excess.
    profiles = _profiles([1.0, 0.5])
    opts = PlanOptions(global_batch=30, grad_bytes=4 * P)
    state = ModelState(params=P, trainable=P, blocks=4)
    modelled = _row(rank_layouts(profiles, state=state, options=opts), "FSDP2")
    ranking = rank_layouts(profiles, state=state, options=opts, fsdp_excess_s=0.05)
    fsdp, dp = _row(ranking, "FSDP2"), _row(ranking, "DP")
    dp_step = 30 / dp.samples_per_s
    assert 30 / fsdp.samples_per_s == pytest.approx(dp_step + 0.05, rel=1e-6)
    assert fsdp.samples_per_s < modelled.samples_per_s and "measured here: +50 ms a step" in fsdp.detail
    assert "measured" not in modelled.detail and fsdp.memory == modelled.memory


def test_capacity_full_trains_on_the_pair_what_even_fsdp2_cannot_and_holds_state_by_room():
    # An 80:24 pair (scaled to 0.8 and 0.24 GB) and a 50M-parameter model: 800 MB of AdamW state
    # (16 B/parameter). Even FSDP2 puts 400 MB on the small card, over its room; capacity-full puts
    # state in proportion to the room each card has left after one sample's activations.
    gb = 1e9
    profiles = _profiles([1.0, 0.67], act=1e6)
    profiles = [replace(profiles[0], memory_bytes=0.8 * gb), replace(profiles[1], memory_bytes=0.24 * gb)]
    opts = PlanOptions(global_batch=16, grad_bytes=4 * P, memory_margin=0.0)
    ranking = rank_layouts(profiles, state=ModelState(params=P, trainable=P, blocks=8), options=opts)
    full, fsdp = _row(ranking, "capacity-full"), _row(ranking, "FSDP2")
    assert not fsdp.fits and full.fits
    room = [0.8 * gb - 1e6, 0.24 * gb - 1e6]
    expected = [16 * P * r / sum(room) for r in room]          # each card's share of the state, by room
    for held, want in zip(full.memory, expected):
        assert held >= want                                      # its shards, plus activations and units
    assert full.memory[0] / full.memory[1] == pytest.approx(room[0] / room[1], rel=0.35)
    assert ranking.best is not None and ranking.best.fits


def test_a_pipeline_row_adds_each_stages_optimizer_and_the_agreement_after_its_schedule():
    """What a step runs after its schedule, as the DP rows count it: the slowest stage's optimizer
    over its part of the parameters (its device's measured optimizer seconds, a whole model's) and
    hetrain's agreement all-reduce."""
    from hetrain.runtime.layouts.pipeline.split import BlockCost, PipelineProfile, StageDevice

    blocks = (BlockCost(seconds=0.01, param_bytes=4e6, activation_bytes=1e6),) * 4
    devices = [StageDevice(name=f"dev{i}", speed=s) for i, s in enumerate((1.0, 0.5))]
    layer = PipelineProfile(blocks=blocks, stage_factor=1.2)
    state = ModelState(params=P, trainable=P, blocks=4)

    def pp(optimizer_s, agree_s):
        profiles = [replace(p, optimizer_s=optimizer_s / s) for p, s in zip(_profiles([1.0, 0.5]), (1.0, 0.5))]
        opts = PlanOptions(global_batch=32, grad_bytes=4 * P, agree_s=agree_s)
        return _row(rank_layouts(profiles, state=state, options=opts, pipeline=(layer, devices)), "PP")

    bare, busy = pp(0.0, 0.0), pp(0.02, 0.003)
    assert bare.detail == busy.detail and "blocks per stage 3/1" in bare.detail
    # stage 1 holds 1 of 4 equal blocks at speed 0.5 (0.04 s a whole model): 0.01 s; stage 0 3/4 of 0.02
    assert 32 / busy.samples_per_s == pytest.approx(32 / bare.samples_per_s + max(0.75 * 0.02, 0.25 * 0.04) + 0.003,
                                                    rel=1e-9)
