"""Gradient compression, planned (planning/compression.py): what each option sends, the sync and
step it predicts, and what 'auto' picks — fp16 (bf16 on NCCL) for a slow inter-node link, nothing
for a fast one or within one node, never PowerSGD. Pure: no processes."""

from __future__ import annotations

import json
import math

import pytest
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from hetrain.errors import UsageError
from hetrain.planning import compression
from hetrain.planning.collectives import FREE_LINK, Link
from hetrain.planning.plan import DevicePlan, Plan

MB = 1e6


def choose(request="auto", *, gbs=1.0, grad_bytes=40 * MB, step_compute=0.1, exposed=None, nodes=True,
           backend="gloo", shapes=(), **kw):
    """A 2-rank ring whose measured exposed sync is the ring model's (unless given): 40 MB over
    1 GB/s is 2·(1/2)·40e6/1e9 = 40 ms, on a 100 ms compute."""
    link = Link(bandwidth_gbs=gbs, latency_s=0.0)
    sync = 2 * (2 - 1) / 2 * grad_bytes / (gbs * 1e9) if exposed is None else exposed
    return compression.choose(request, grad_bytes=grad_bytes, ring=2, link=link, step_s=step_compute + sync,
                              exposed_s=sync, spans_nodes=nodes, backend=backend, grad_shapes=shapes, **kw)


def test_a_slow_inter_node_link_gets_fp16_with_the_predicted_gain_in_the_reason():
    c = choose(gbs=1.0)
    assert c.name == "fp16"
    fp16, none = c.option("fp16"), c.option("none")
    # by hand: half the bytes, half the 40 ms sync; step 140 -> 120 ms, +16.7% samples/s
    assert fp16.sent_bytes == 20 * MB and fp16.sync_s == pytest.approx(0.020) and fp16.step_s == pytest.approx(0.120)
    assert none.step_s == pytest.approx(0.140)
    assert c.reason == ("gradient compression fp16: inter-node link 1 GB/s, sync 40 ms -> 20 ms, "
                        "predicted +17% samples/s")


def test_a_fast_link_or_one_node_gets_none():
    fast = choose(gbs=100.0)                 # 0.4 ms of sync on a 100 ms step: +0.2%
    assert fast.name == "none" and "under the 5%" in fast.reason and "predicted +0% samples/s" in fast.reason
    one_node = choose(gbs=1.0, nodes=False)  # within a node the plan is left alone, and nothing said
    assert one_node.name == "none" and one_node.reason == ""


def test_nccl_gets_bf16_and_gloo_refuses_an_explicit_bf16_naming_fp16():
    assert choose(backend="nccl").name == "bf16"
    with pytest.raises(UsageError) as e:
        choose("bf16", backend="gloo")
    assert "bf16_compress_hook" in e.value.what and "Compression(method='fp16')" in e.value.fix


def test_what_the_link_does_not_explain_stays_in_the_sync():
    # 50 ms measured where the ring model explains 40: the 10 ms beyond it is not bytes, it stays
    c = choose(gbs=1.0, exposed=0.050)
    assert c.option("fp16").sync_s == pytest.approx(0.010 + 0.020)
    # a link not measured (one device, or not modelled) predicts no change
    free = compression.choose("fp16", grad_bytes=40 * MB, ring=2, link=FREE_LINK, step_s=0.14, exposed_s=0.04,
                              spans_nodes=True, backend="gloo")
    assert free.name == "fp16" and free.option("fp16").sync_s == pytest.approx(0.04)
    assert "communication not measured" in free.reason


SHAPES = ((4096, 1024), (4096,), (1024, 4096), (1024,), (64, 3, 3, 3), (8, 8), ())


def test_powersgd_bytes_are_what_torchs_hook_decides_to_send():
    rank = 4
    expected = 0
    for shape in SHAPES:                      # torch's own rule, tensor by tensor (powerSGD_hook)
        n = shape[0] if shape else 1
        m = math.prod(shape) // n if shape else 1
        worth, before, after = _should_compress(n, m, min(n, m, rank), 2.0)
        expected += after if worth and len(shape) > 0 else before
    assert compression.powersgd_elements(SHAPES, rank) == expected
    numel = sum(math.prod(s) for s in SHAPES)
    assert compression.sent_bytes("powersgd", grad_bytes=4 * numel, grad_shapes=SHAPES, powersgd_rank=rank) == \
        4 * expected
    assert compression.sent_bytes("powersgd", grad_bytes=4 * numel) is None      # no shapes, no prediction


def test_auto_never_picks_powersgd_but_says_when_it_would_gain_much_more():
    shapes = ((4096, 1024), (1024, 4096), (4096,))
    grad_bytes = 4 * sum(math.prod(s) for s in shapes)
    c = choose(gbs=1.0, grad_bytes=grad_bytes, shapes=shapes)
    assert c.name == "fp16"
    assert c.option("powersgd").gain(c.option("none")) > c.option("fp16").gain(c.option("none")) + 0.10
    assert "PowerSGD (rank 4) would give" in c.reason and "Compression(method='powersgd')" in c.reason
    asked = choose("powersgd", gbs=1.0, grad_bytes=grad_bytes, shapes=shapes)
    assert asked.name == "powersgd" and "(asked for)" in asked.reason and "approximates the gradient" in asked.reason


def test_where_compression_cannot_run_auto_is_none_and_a_request_names_dp():
    blocked = choose(gbs=1.0, blocked_by="parallel='tp'")
    assert blocked.name == "none" and "parallel='tp'" in blocked.reason
    with pytest.raises(UsageError) as e:
        choose("fp16", blocked_by="sharding='fsdp'")
    assert "parallel=hetrain.DataParallel(sharding='none')" in e.value.fix


def plan() -> Plan:
    devices = tuple(DevicePlan(rank=r, device=f"d{r}", speed=1.0, share=32, micro_batch=8) for r in range(2))
    return Plan(global_batch=64, devices=devices, note="planned: ...",
                predicted={"step_s": 0.14, "samples_per_s": 64 / 0.14, "comm_exposed_s": 0.04,
                           "standalone_sum_samples_per_s": 1000.0})


def test_the_plan_records_the_choice_its_reason_and_the_compressed_prediction():
    p = compression.apply(plan(), choose(gbs=1.0))
    assert p.compression == "fp16" and p.version == 0
    assert p.note.split("; ")[-1].startswith("gradient compression fp16: ")
    assert p.predicted["step_s"] == pytest.approx(0.12) and p.predicted["uncompressed_step_s"] == pytest.approx(0.14)
    assert p.predicted["samples_per_s"] == pytest.approx(64 / 0.12)
    assert Plan.from_json(p.to_json()) == p
    old = json.loads(plan().to_json())         # a plan written before compression existed
    old["schema"] = 3
    del old["compression"]
    assert Plan.from_json(json.dumps(old)).compression == "none"
    assert compression.apply(plan(), choose(gbs=1.0, nodes=False)) == plan()    # one node: untouched
