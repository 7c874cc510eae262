"""The runtime plans with the planner: every rank measures its device, all gather the profiles and
run the same pure planner, and then do exactly what the plan says; a restart reuses the profiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist


def planned_job(rank, world, emulate, global_batch, steps, plan=None):
    import hetrain
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes

    ht = hetrain.init(global_batch=global_batch, max_steps=steps, emulation=Emulation(cluster=emulate),
                      reporting=Reporting(verbose=False), plan=plan)
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, batches = ht.prepare(model, opt, ByteWindows(pydoc_bytes()[:100_000], 32))
    local, counts = [], []
    for step in batches:
        sizes = []
        for mb in step:
            with mb:
                x, y = mb.batch
                sizes.append(len(x))
                ht.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        ht.step()
        local.append(sum(sizes))
        counts.append(len(sizes))
    summary = ht.summary()
    result = {"plan": ht.plan, "local": local, "counts": counts, "peak": summary["ranks"][rank]["peak_bytes"]}
    ht.close()
    return result


def test_ranks_plan_alike_and_run_the_plan_and_a_restart_reuses_the_profiles(tmp_path):
    env = {"HETRAIN_CACHE": str(tmp_path)}
    spec = "a100-80g:1.0,rtx3090:0.5@1.2MiB"
    # Global batch 96: the slow device's share is then at least twice its 4-sample memory cap on
    # any host (its share is set by measured speed, and a micro-batch's fixed cost varies by CPU:
    # at 48 an AVX2 host gave it 4 samples, one micro-batch)
    r0, r1 = run_ranks(planned_job, 2, spec, 96, 3, env=env)
    plan = r0["plan"]
    assert plan == r1["plan"]                                     # the same pure planner on the same profiles
    assert plan.note.startswith("planned:") and plan.predicted["samples_per_s"] > 0
    assert plan.predicted["ddp_samples_per_s"] > 0 and plan.version == 0
    fast, slow = plan.devices
    assert fast.share > slow.share and fast.share + slow.share == 96
    assert "1.2 MiB memory" in slow.reasons[1] and slow.memory_cap_bytes == int(1.2 * 1024**2)
    for r, rank_result in enumerate((r0, r1)):
        d = plan.devices[r]
        assert rank_result["local"] == [d.share] * 3               # exactly its share…
        assert rank_result["counts"] == [d.n_micro] * 3            # …in the plan's micro-batches
    assert slow.n_micro > 1 and 0 < r1["peak"] <= 1.2 * 1024**2   # the cap held
    assert slow.predicted_memory_bytes == pytest.approx(r1["peak"], rel=0.25)

    cached = {p: p.stat().st_mtime_ns for p in (tmp_path / "profiles").glob("*.json")}
    assert cached
    again = run_ranks(planned_job, 2, spec, 96, 1, env=env)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "profiles").glob("*.json")} == cached
    assert again[0]["plan"] == again[1]["plan"]


def test_a_plan_from_the_pure_planner_runs_as_given(tmp_path):
    from hetrain.planning.collectives import FREE_LINK
    from hetrain.planning.planner import PlanOptions, make_plan
    from hetrain.planning.profile import DeviceProfile

    def device(name, per_sample, memory):
        return DeviceProfile(device=name, source="given", overhead_s=0.001, per_sample_s=per_sample,
                             fixed_bytes=10**6, activation_bytes_per_sample=10**5, memory_bytes=memory)

    plan = make_plan([device("a", 0.001, None), device("b", 0.003, 10**6 + 5 * 10**5)],
                     PlanOptions(global_batch=40, link=FREE_LINK, memory_margin=0.0, allow_exclusion=False))
    a, b = plan.shares
    assert a > 2 * b and plan.devices[1].n_micro == 2            # memory: b runs micro-batches of 5
    r0, r1 = run_ranks(planned_job, 2, "a100-80g,rtx3090", 40, 2, plan, env={"HETRAIN_CACHE": str(tmp_path)})
    assert r0["plan"] == plan and r0["local"] == [a, a] and r1["local"] == [b, b]
    assert r0["counts"] == [1, 1] and r1["counts"] == [2, 2]
    assert not (tmp_path / "profiles").exists()                   # a given plan measures nothing
