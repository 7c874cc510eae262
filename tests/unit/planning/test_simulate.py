"""Strategies side by side, presets, and the answers people ask for."""

from __future__ import annotations

import json

import pytest

from hetrain.errors import UsageError
from hetrain.hardware.cluster import parse_cluster
from hetrain.planning.cost import GRAD_ELEMENT_BYTES
from hetrain.planning.presets import PRESETS, preset, transformer
from hetrain.planning.simulate import cluster_profiles, simulate


def run(spec, model, batch=256, **kw):
    m = preset(model)
    profiles = cluster_profiles(parse_cluster(spec), m, **kw)
    return simulate(profiles, global_batch=batch, grad_bytes=m.params * GRAD_ELEMENT_BYTES), profiles


def test_a100_plus_3090_three_strategies_and_the_answers():
    sim, profiles = run("a100-80g,rtx3090", "gpt2-124m")
    single, ddp, het = sim.strategies
    assert [s.name for s in sim.strategies] == ["fastest single device", "plain DDP equal split", "hetrain"]
    # Speeds 1 : 0.67 (the catalog index): DDP runs at 2 × 0.67, hetrain near 1.67, alone 1.
    assert ddp.samples_per_s / single.samples_per_s == pytest.approx(1.33, abs=0.03)
    assert het.samples_per_s / single.samples_per_s == pytest.approx(1.66, abs=0.03)
    assert het.efficiency <= 1.0 + 1e-9 and het.efficiency > 0.95 and ddp.efficiency == pytest.approx(0.8, abs=0.02)
    assert "a100-80g#0" in single.why
    text = " ".join(sim.answers)
    assert "adding rtx3090#1 to a100-80g#0: hetrain ×1.6" in text
    assert "bottleneck under plain DDP: rtx3090#1" in text
    assert all(len(s.memory_per_device) == 2 for s in sim.strategies)
    assert single.memory_per_device[1]["bytes"] is None            # the 3090 is idle alone
    rows = {r.device: r for r in sim.devices}
    assert rows["rtx3090#1"].adds_samples_per_s == pytest.approx(het.samples_per_s - single.samples_per_s)
    data = sim.to_dict()
    json.dumps(data)
    assert {"name", "samples_per_s", "efficiency", "memory_per_device"} <= set(data["strategies"][0])


def test_peak_ratios_follow_the_datasheets():
    sim, profiles = run("a100-80g,rtx3090", "gpt2-124m", ratios="peak")
    a100, r3090 = profiles
    assert a100.per_sample_s / r3090.per_sample_s == pytest.approx(71 / 312)


def test_a_card_too_small_is_left_out_with_the_reason_and_ddp_cannot_run():
    sim, _ = run("a100-80g,rtx3090,t4", "llama-1b", batch=64)
    single, ddp, het = sim.strategies
    assert ddp.samples_per_s == 0.0 and "cannot run" in ddp.why and "t4#2" in ddp.why
    assert [d.device for d in sim.plan.devices] == ["a100-80g#0", "rtx3090#1"]
    (left,) = sim.plan.excluded
    assert left.device == "t4#2" and left.kind == "memory" and "FSDP" in left.fix
    assert any("t4#2 is left out" in a for a in sim.answers)
    # The ring without the T4 runs on PCIe 4, not the T4's PCIe 3.
    assert sim.link.bandwidth_gbs == 24.0


def test_identical_cards_use_nvlink_and_split_evenly():
    sim, _ = run("2xa100-80g", "gpt2-124m")
    assert sim.plan.shares == (128, 128)
    assert sim.link.bandwidth_gbs == pytest.approx(240)
    single, ddp, het = sim.strategies
    assert ddp.samples_per_s == pytest.approx(het.samples_per_s)


def test_a_model_that_fits_nowhere_is_a_usage_error():
    with pytest.raises(UsageError, match="fits on no device") as e:
        run("a100-80g,rtx3090", "llama-8b")
    assert "shard" in e.value.fix


def test_presets_state_their_numbers():
    gpt2 = PRESETS["gpt2-124m"]
    assert gpt2.flops_per_sample == pytest.approx(1024 * (6 * gpt2.params + 12 * 12 * 768 * 1024))
    assert 5e8 < gpt2.activation_bytes_per_sample < 8e8 and "1024 tokens" in gpt2.assumptions
    assert PRESETS["resnet50"].flops_per_sample == pytest.approx(24.6e9)
    for spec in PRESETS.values():
        assert spec.assumptions and 0 < spec.checkpoint_fraction <= 1
    custom = transformer("t", params=10**6, layers=2, d_model=64, seq_len=32, vocab=100)
    assert custom.activation_bytes_per_sample == 2 * 34 * 32 * 64 + 32 * 100 * 6 + 2 * 32 * 64


def test_unknown_preset_suggests_close_names():
    with pytest.raises(UsageError, match="did you mean: gpt2-124m") as e:
        preset("gpt2-124")
    assert "--params" in e.value.fix
