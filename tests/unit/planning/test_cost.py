"""The cost model: ring all-reduce, overlap, catalog compute and memory (what emulated devices
sharing a host add: tests/unit/emulation/test_shared_host.py)."""

from __future__ import annotations

import math

import pytest

from hetrain.errors import UsageError
from hetrain.hardware import catalog
from hetrain.planning.collectives import FREE_LINK, Link, allreduce_seconds, link_from_measurement
from hetrain.planning.cost import (DDP_BUCKET_BYTES, Assignment, catalog_link, estimate_profile, fixed_bytes,
                                   gradient_sync, peak_flops, step_cost)
from hetrain.planning.presets import preset
from hetrain.planning.profile import DeviceProfile

GB = 1e9


def test_ring_allreduce_is_2_n_minus_1_over_n_times_size_over_bandwidth():
    link = Link(bandwidth_gbs=10.0, latency_s=0.0)
    assert allreduce_seconds(1, 4 * GB, link) == 0.0
    assert allreduce_seconds(2, 4 * GB, link) == pytest.approx(0.4)          # 2·1/2 · 4/10
    assert allreduce_seconds(4, 4 * GB, link) == pytest.approx(0.6)          # 2·3/4 · 4/10
    lat = Link(bandwidth_gbs=10.0, latency_s=1e-3)
    assert allreduce_seconds(4, 0, lat) == pytest.approx(6e-3)               # 2(n−1) hops
    measured = link_from_measurement(4, 4 * GB, 0.6, "test")
    assert measured.bandwidth_gbs == pytest.approx(10.0)


def test_overlap_hides_the_sync_under_backward_but_never_the_last_bucket():
    link = Link(bandwidth_gbs=10.0, latency_s=0.0)
    total = allreduce_seconds(2, 1 * GB, link)
    last = allreduce_seconds(2, DDP_BUCKET_BYTES, link)
    hidden = gradient_sync(2, 1 * GB, link, backward_window_s=10.0)
    assert hidden.total_s == pytest.approx(total) and hidden.exposed_s == pytest.approx(last)
    assert hidden.overlapped_s + hidden.exposed_s == pytest.approx(total)
    none = gradient_sync(2, 1 * GB, link, backward_window_s=0.0)
    assert none.exposed_s == pytest.approx(total) and none.overlapped_s == 0.0
    part = gradient_sync(2, 1 * GB, link, backward_window_s=0.03)
    assert part.exposed_s == pytest.approx(total - 0.03)
    assert gradient_sync(1, 1 * GB, link, backward_window_s=0).total_s == 0.0


def test_catalog_links():
    a100, r3090, t4 = (catalog.resolve(n) for n in ("a100-80g", "rtx3090", "t4"))
    assert catalog_link([a100, a100]).source.startswith("NVLink")
    assert catalog_link([a100, a100]).bandwidth_gbs == pytest.approx(0.4 * 600)
    mixed = catalog_link([a100, r3090])
    assert "PCIe 4.0" in mixed.source and "mixed" in mixed.source
    assert catalog_link([a100, t4]).bandwidth_gbs < mixed.bandwidth_gbs   # PCIe 3 is the slowest link


def test_compute_from_flops_and_the_catalog_peak():
    a100 = catalog.resolve("a100-80g")
    gpt2 = preset("gpt2-124m")
    p = estimate_profile(gpt2, a100, label="a100", precision="bf16", efficiency=0.4)
    assert p.per_sample_s == pytest.approx(gpt2.flops_per_sample / (312e12 * 0.4))
    fp32 = estimate_profile(gpt2, a100, label="a100", precision="fp32", efficiency=0.4)
    assert fp32.per_sample_s == pytest.approx(gpt2.flops_per_sample / (19.5e12 * 0.4))
    assert fp32.activation_bytes_per_sample == pytest.approx(2 * p.activation_bytes_per_sample)
    assert p.fixed_bytes == fixed_bytes(gpt2.params, "adamw") == 16 * gpt2.params
    peak, why = peak_flops(catalog.resolve("t4"), "bf16")        # no bf16 tensor cores
    assert peak == 8.1e12 and "no bf16" in why


def _prof(per_sample, cpu_share=0.0, overhead=0.0, opt=0.0):
    return DeviceProfile(device=f"d{per_sample}", source="t", overhead_s=overhead, per_sample_s=per_sample,
                         optimizer_s=opt, fixed_bytes=0, activation_bytes_per_sample=0, cpu_share=cpu_share)


def test_step_is_slowest_compute_plus_exposed_sync_plus_optimizer():
    a = Assignment(profile=_prof(0.01, overhead=0.002, opt=0.005), share=40, micro_batch=16)   # 3 micro-batches
    b = Assignment(profile=_prof(0.02, opt=0.009), share=20, micro_batch=20)
    cost = step_cost([a, b], global_batch=60, grad_bytes=0, link=FREE_LINK)
    assert cost.compute_s[0] == pytest.approx(3 * 0.002 + 0.4)
    assert cost.step_s == pytest.approx(0.406 + 0.009)
    assert cost.samples_per_s == pytest.approx(60 / 0.415) and cost.bottleneck == 0


def test_bad_links_and_efficiency():

    with pytest.raises(UsageError):
        Link(bandwidth_gbs=0)
    with pytest.raises(UsageError, match="efficiency"):
        estimate_profile(preset("resnet50"), catalog.resolve("t4"), label="t4", efficiency=1.5)
    with pytest.raises(UsageError, match="optimizer"):
        fixed_bytes(10, "lion")
    assert math.isinf(FREE_LINK.bandwidth_gbs)


