"""The metrics stream of a real 2-rank emulated run: one line per step with every rank's figures,
an OOM as an event line, and a restarted attempt appending to the same file."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Checkpoints, Memory, Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

GLOBAL_BATCH, SAMPLE_S = 24, 0.002
OOM = "oom:rank=1,step=1,micro=0,phase=forward"
# the given plan's devices, as a measured plan names them and the catalog sizes them
NAMES, CAPS = ("a100-80g#0 (emulated)", "rtx3090#1 (emulated)"), (80 * 1024**3, 24 * 1024**3)


def job(checkpoint_dir, steps, faults):
    """A small GPT on the controlled clock (emulate_sample_s: timings hold under load), on a given
    plan (16/8 by the pair's catalog speeds, micro-batches of 8); metrics go to
    checkpoint_dir/metrics, the default when checkpointing."""
    import hetrain
    from hetrain.demo.gpt import GPT, GPTConfig
    from plans import data_plan

    ht = hetrain.init(global_batch=GLOBAL_BATCH, max_steps=steps, plan=data_plan((16, 8), (8, 8), names=NAMES, caps=CAPS),
                      emulation=Emulation(cluster="a100-80g,rtx3090", sample_s=SAMPLE_S, faults=faults),
                      reporting=Reporting(verbose=False), memory=Memory(max_micro_batch=8),
                      checkpoints=Checkpoints(dir=checkpoint_dir, every=100), rebalancing=Rebalancing(enabled=False))
    torch.manual_seed(0)
    x = torch.randint(0, 64, (96, 16), generator=torch.Generator().manual_seed(1))
    net = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    net, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05),
                                   torch.utils.data.TensorDataset(x, x))
    for step in batches:
        for mb in step:
            with mb:
                a, b = mb.batch
                ht.backward(F.cross_entropy(net(a).flatten(0, 1), b.flatten()))
        ht.step()
    summary = ht.summary()
    ht.close()
    return summary


def worker(rank, world, checkpoint_dir, path):
    """Both attempts in one process group: the second as torchrun's restart (its count 1)."""
    from pipeline_runs import join_group

    join_group()
    first = job(checkpoint_dir, 5, OOM)
    with open(path) as f:
        after_first = f.read()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    second = job(checkpoint_dir, 7, None)
    return first, second, after_first


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """5 steps (an OOM on rank 1 at step 1), then a restarted attempt (torchrun's count 1) resuming
    from the last checkpoint for 2 steps more, into the same directory."""
    ckpt = str(tmp_path_factory.mktemp("metrics") / "ckpt")
    path = os.path.join(ckpt, "metrics", "metrics.jsonl")
    (first, second, after_first), _ = run_ranks(worker, 2, ckpt, path)
    with open(path) as f:
        after_second = f.read()
    return {"dir": os.path.dirname(path), "first": first, "second": second,
            "lines1": [json.loads(t) for t in after_first.splitlines()], "text1": after_first,
            "lines2": [json.loads(t) for t in after_second.splitlines()], "text2": after_second}


def test_one_line_per_step_with_every_ranks_figures(runs):
    lines, summary = runs["lines1"], runs["first"]
    start = lines[0]
    assert start["event"] == "start" and start["attempt"] == 0 and start["world_size"] == 2
    assert [d["name"] for d in start["devices"]] == list(NAMES)
    steps = [ln for ln in lines if "event" not in ln]
    assert [s["step"] for s in steps] == list(range(5))
    for s in steps:
        assert len(s["devices"]) == 2 and [d["rank"] for d in s["devices"]] == [0, 1]
        assert sum(d["share"] for d in s["devices"]) == GLOBAL_BATCH
        for d in s["devices"]:
            assert d["micro_batches"] * d["micro_batch"] >= d["share"]
            assert 0 < d["compute_s"] <= 1.1 * s["step_s"] + 0.01       # slack: ranks' clocks start apart
            assert d["sync_s"] >= 0 and d["wait_s"] >= 0
            assert 0 < d["peak_bytes"] <= d["memory_cap_bytes"]         # the emulated meter, this step
            # a controlled-clock micro-batch of m samples lasts m·SAMPLE_S/speed: compute is at least that
            assert d["compute_s"] >= 0.9 * d["share"] * SAMPLE_S
    assert steps[-1]["loss"] == summary["last_loss"]
    assert steps[0]["loss"] == summary["first_loss"]


def test_an_oom_is_an_event_line_and_the_next_lines_run_the_amended_plan(runs):
    lines = runs["lines1"]
    (oom,) = [ln for ln in lines if ln.get("event") == "oom"]
    assert (oom["step"], oom["rank"], oom["micro_batch_before"], oom["micro_batch_after"]) == (1, 1, 8, 4)
    steps = {ln["step"]: ln for ln in lines if "event" not in ln}
    assert steps[0]["plan_version"] == 0 and steps[1]["plan_version"] == oom["plan_version"] == 1
    assert steps[0]["devices"][1]["micro_batch"] == 8 and steps[1]["devices"][1]["micro_batch"] == 4
    assert lines.index(oom) < lines.index(steps[1])           # the event, then the step it happened in


def test_mfu_per_line_and_in_the_summary_from_the_headers_flops_and_peaks(runs):
    lines, summary = runs["lines1"], runs["first"]
    start = lines[0]
    flops, peaks = start["flops_per_sample"], [d["peak_flops"] for d in start["devices"]]
    assert flops > 0 and all(p > 0 for p in peaks)
    for s in (ln for ln in lines if "event" not in ln):
        for d in s["devices"]:
            assert d["mfu"] == pytest.approx(d["share"] * flops / d["compute_s"] / peaks[d["rank"]])
    assert len(summary["mfu"]) == len(summary["efficiency"]) == 2
    assert all(0 < m < 1 for m in summary["mfu"]) and all(0 < e <= 1.1 for e in summary["efficiency"])
    assert summary["flops_per_sample"] == flops


def test_a_restart_appends_a_restart_event_and_its_steps(runs):
    assert runs["text2"].startswith(runs["text1"])                     # appended: nothing rewritten
    new = runs["lines2"][len(runs["lines1"]):]
    assert new[0]["event"] == "restart" and new[0]["attempt"] == 1 and new[0]["step"] == 5
    assert new[1]["event"] == "start" and new[1]["attempt"] == 1
    assert [ln["step"] for ln in new[2:] if "event" not in ln] == [5, 6]
    assert new[-1]["loss"] == runs["second"]["last_loss"]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install hetrain[tensorboard])")
def test_tensorboard_scalars_beside_the_metrics_when_tensorboard_is_installed(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = [f for f in os.listdir(runs["dir"]) if f.startswith("events.out.tfevents")]
    assert len(files) == 2                                           # one per attempt
    acc = EventAccumulator(os.path.join(runs["dir"], sorted(files)[0]))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "loss" in tags and "samples_per_s" in tags
    assert {t.split("/")[0] for t in tags if "/" in t} >= {"compute_s", "wait_s", "sync_s", "mfu"}
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(
        [ln["loss"] for ln in runs["lines1"] if "event" not in ln])
