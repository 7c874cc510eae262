"""The simulator reproduces the shape of the seed's published table (the product's founding figures: A100 120 samples/s
alone, RTX 3090 80, both 190; equal-split DDP 2 × 80): the figures benchmarks/published.py prints,
computed by the same function, so the benchmark and this test cannot drift apart."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hetrain.planning.presets import SHAPES, preset

ROOT = Path(__file__).resolve().parents[3]


def load_published():
    spec = importlib.util.spec_from_file_location("published_bench", ROOT / "benchmarks" / "published.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_seed_case_has_the_published_shape():
    bench = load_published()
    sim = bench.simulate_spec(bench.SEED_CLUSTER, preset(bench.SEED_MODEL), global_batch=bench.SEED_BATCH)
    alone = [row.standalone_samples_per_s for row in sim.devices]
    strategies = {s.name: s.samples_per_s for s in sim.strategies}
    together, ddp = strategies["hetrain"], strategies["plain DDP equal split"]
    fastest, slower = max(alone), min(alone)
    # Adding the 3090 helps: the pair beats the A100 alone, but not the sum of the two.
    assert fastest < together <= sum(alone) * (1 + 1e-9)
    # The uneven split keeps more of the sum than the equal split does.
    assert together / sum(alone) > ddp / sum(alone)
    # Equal shares wait for the slower card: two devices at its speed, less only what the step adds.
    assert ddp == pytest.approx(2 * slower, rel=0.03) and ddp <= 2 * slower
    # The benchmark reports these same figures.
    figures = bench.seed_dp()
    assert figures["together / A100"] == pytest.approx(together / fastest)
    assert figures["equal-split DDP / sum"] == pytest.approx(ddp / sum(alone))


def test_the_opt_350m_preset_counts_a_tied_megatron_gpt_of_its_shape():
    s = SHAPES["opt-350m"]
    d, L, V, T = s["d_model"], s["layers"], s["vocab"], s["seq_len"]
    per_layer = 12 * d * d + 13 * d         # qkv, projection, two MLP matrices and their biases, two norms
    assert s["params"] == L * per_layer + V * d + T * d + 2 * d
    assert preset("opt-350m").params == s["params"]
