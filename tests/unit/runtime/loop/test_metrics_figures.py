"""MFU's arithmetic, the measured FLOPs per sample, where metrics go, and the status lines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hetrain.hardware.host import HostFacts
from hetrain.runtime.config import Config
from hetrain.runtime.loop import flops, metrics
from hetrain.runtime.user_objects import default_forward
from hetrain import Checkpoints, Reporting


def test_mfu_is_achieved_flops_over_the_peak():
    # 32 samples × 6e9 FLOPs in 0.5 s = 384 TFLOP/s, on a 989 TFLOP/s peak
    assert flops.mfu(samples=32, flops_per_sample=6e12, compute_s=0.5, peak_flops=989e12) == pytest.approx(
        384e12 / 989e12)
    facts = flops.FlopFacts(flops_per_sample=1e6, how="", peaks=(1e9, None), meaning="")
    assert facts.mfu(0, samples=100, compute_s=0.4) == pytest.approx(100 * 1e6 / 0.4 / 1e9)   # 25%
    assert facts.mfu(1, samples=100, compute_s=0.4) is None          # no peak known for that device
    assert flops.mfu(samples=8, flops_per_sample=None, compute_s=1.0, peak_flops=1e12) is None
    assert flops.mfu(samples=8, flops_per_sample=1e9, compute_s=0.0, peak_flops=1e12) is None


def test_an_emulated_devices_peak_is_the_cpu_threads_matmul_rate_times_its_speed():
    # host.py's matmul is 512×256 @ 256×512: 2·512·256·512 FLOPs; 1 ms of it is 134 GFLOP/s
    host = HostFacts(cpu="x", flags=(), torch="2", matmul_ms={"fp32": 1.0})
    assert host.matmul_flops("fp32") == pytest.approx(2 * 512 * 256 * 512 / 1e-3)
    assert host.matmul_flops("bf16") is None
    from hetrain.emulation.profiling import EmulatedMeasuring

    measuring = EmulatedMeasuring(SimpleNamespace(speed=0.5), None, torch.device("cpu"))
    job = SimpleNamespace(precision=SimpleNamespace(compute="fp32"), host=host,
                          hooks=SimpleNamespace(measuring=lambda: measuring))
    assert flops.local_peak(job) == pytest.approx(0.5 * 2 * 512 * 256 * 512 / 1e-3)     # × its speed
    assert flops.local_peak(SimpleNamespace(**{**vars(job), "precision": SimpleNamespace(compute="bf16")})) is None


def test_flops_per_sample_measured_for_a_linear_layer_and_the_model_left_as_it_was():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    stats = net[1].running_mean.clone()
    x = torch.randn(2, 16)
    got, how = flops.count_flops_per_sample(net, (x, None), 2, default_forward)
    # forward 2·(16·32 + 32·4) per sample; backward: input gradient of the second layer (2·32·4) and
    # both weight gradients (2·16·32 + 2·32·4); the first layer's input needs none
    forward = 2 * (16 * 32 + 32 * 4)
    assert got == pytest.approx(forward + 2 * 32 * 4 + 2 * (16 * 32 + 32 * 4))
    assert "measured" in how
    assert net.training and all(p.grad is None for p in net.parameters())
    assert torch.equal(net[1].running_mean, stats)                  # batch norm's statistics untouched


def test_metrics_go_to_metrics_dir_or_beside_the_checkpoints():
    assert Config(global_batch=8).metrics_path() is None
    assert Config(global_batch=8, checkpoints=Checkpoints(dir="/c")).metrics_path() == "/c/metrics"
    ckpt = Checkpoints(dir="/c")
    assert Config(global_batch=8, checkpoints=ckpt, reporting=Reporting(metrics_dir="/m")).metrics_path() == "/m"
    assert Config(global_batch=8, checkpoints=ckpt, reporting=Reporting(metrics_dir="")).metrics_path() is None
    with pytest.raises(Exception, match="status_every"):
        Config(global_batch=8, reporting=Reporting(status_every=-1))


def test_status_lines_name_each_device_with_its_figures():
    line = {"step": 9, "loss": 2.5, "samples_per_s": 512.0, "plan_version": 2, "devices": [
        {"device": "a100-80g#0", "share": 38, "micro_batch": 16, "micro_batches": 3, "compute_s": 0.095,
         "wait_s": 0.005, "sync_s": 0.003, "peak_bytes": 3 * 2**30, "memory_cap_bytes": 80 * 2**30, "mfu": 0.31},
        {"device": "cpu (rank 1)", "share": 26, "micro_batch": 26, "micro_batches": 1, "compute_s": 0.1,
         "wait_s": 0.0, "sync_s": 0.004, "peak_bytes": None, "memory_cap_bytes": None, "mfu": None}]}
    head, first, second = metrics.status_lines(line, total=100)
    assert head == "status at step 10/100: loss 2.5000, 512.0 samples/s, plan v2"
    assert "share 38 (3 micro-batches, max 16)" in first and "compute 95 ms, wait 5 ms, sync 3 ms" in first
    assert "memory 3.0 GiB of 80.0 GiB, MFU 31%" in first
    assert second.endswith("memory -") and "MFU" not in second


def test_the_recorders_lines_for_a_step_a_skip_a_rebalance_and_an_oom(tmp_path):
    """Rank 0's Recorder fed as the loop feeds it, on a stand-in job: the lines it appends."""
    import io
    import json
    from dataclasses import replace
    from types import SimpleNamespace

    from hetrain.planning.plan import DevicePlan, Plan
    from hetrain.runtime.ranks import agree

    plan = Plan(global_batch=24, devices=tuple(
        DevicePlan(rank=r, device=f"dev{r}", speed=1.0, share=s, micro_batch=8, memory_cap_bytes=2**30)
        for r, s in enumerate((14, 10))))
    printed = []
    job = SimpleNamespace(plan=plan, config=SimpleNamespace(global_batch=24), total_steps=10,
                          flops=flops.FlopFacts(flops_per_sample=1e6, how="", peaks=(1e9, 1e9), meaning=""),
                          precision=SimpleNamespace(loss_scale=512.0), log=SimpleNamespace(info=printed.append))
    out = io.StringIO()
    recorder = metrics.Recorder(job, out=out, tensorboard=None, status_every=2)
    rows = [[14.0, 40.0, 0.02, 0.03, 0.0, 8, 0, 0, 0, 0, 0, 0.004, 5e5],
            [10.0, 30.0, 0.02, 0.025, 0.0, 8, 0, 0, 0, 0, 0, 0.002, 4e5]]
    table = agree.Table(agree.STEP_KEYS, torch.tensor(rows, dtype=torch.float64))
    recorder.record("step", step=SimpleNamespace(index=1, loss=2.5, samples_per_s=0.0), table=table,
                    period=0.04, stepped=False)
    after = plan.evolve(note="rebalanced", devices=(replace(plan.devices[0], share=12),
                                                    replace(plan.devices[1], share=12)))
    recorder.record("rebalance", step=1, before=plan, after=after, message="rebalanced at step 2")
    job.plan = plan.evolve(note="oom", devices=(plan.devices[0], replace(plan.devices[1], micro_batch=4)))
    recorder.record("oom", step=2, before=plan, redone=True)
    step, skipped, rebalance, oom = (json.loads(t) for t in out.getvalue().splitlines())
    assert step["samples_per_s"] == pytest.approx(600) and step["step_s"] == 0.04
    d0, d1 = step["devices"]
    assert (d0["compute_s"], d0["sync_s"], d0["wait_s"]) == pytest.approx((0.03, 0.004, 0.006))
    assert d1["peak_bytes"] == 400_000 and d1["memory_cap_bytes"] == 2**30
    assert d0["mfu"] == pytest.approx(14 * 1e6 / 0.03 / 1e9)
    assert skipped == {"event": "skipped_step", "step": 1, "reason": "inf/NaN gradients (fp16 overflow)",
                       "loss_scale": 512.0}
    assert (rebalance["shares_before"], rebalance["shares_after"], rebalance["version_after"]) == ([14, 10], [12, 12], 1)
    assert (oom["rank"], oom["micro_batch_before"], oom["micro_batch_after"]) == (1, 8, 4)
    assert oom["redo"].startswith("every rank")
    assert printed[0].startswith("status at step 2/10") and len(printed) == 3     # the step, then each device
