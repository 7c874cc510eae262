"""`hetrain simulate` and `hetrain plan` as a user meets them: the answers, the JSON, a plan that
`hetrain.init(plan=...)` runs, and bad input as one line with the fix (exit 2, no traceback).

Commands that start no process (simulate, plan from a preset, input checked before launching) run
in this process (`hetrain_here`); the first test and those that measure or train run `hetrain` as
a process, so the real command line is covered too."""

from __future__ import annotations

import re

import json
import textwrap

import pytest

from clirun import hetrain, hetrain_here, one_line_error
from hetrain.planning.plan import Plan
from hetrain.runtime.config import Config
from hetrain.runtime.measure.joint import SYNC_RUNS, sync_runs
from hetrain.runtime.measure.measurements import Measurements, plan_from_measurements
from hetrain.emulation import Emulation


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path / "cache"))


def test_simulate_answers_what_a_3090_buys_and_which_card_is_the_bottleneck():
    r = hetrain_here("simulate", "--cluster", "a100-80g,rtx3090", "--model", "gpt2-124m", "--global-batch", "128")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for words in ("fastest single device", "plain DDP equal split", "hetrain", "samples/s", "efficiency",
                  "adding rtx3090#1 to a100-80g#0: hetrain ×1.6", "bottleneck under plain DDP: rtx3090#1",
                  "no processes"):
        assert words in out, out


def test_simulate_json():
    r = hetrain_here("simulate", "--cluster", "a100-80g,rtx3090,t4", "--params", "124e6", "--flops-per-sample",
                "8.8e11", "--activation-bytes", "600MiB", "--global-batch", "96", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    names = [s["name"] for s in data["strategies"]]
    assert names == ["fastest single device", "plain DDP equal split", "hetrain"]
    for s in data["strategies"]:
        assert s["samples_per_s"] > 0 and 0 < s["efficiency"] <= 1.0 + 1e-9
        assert [m["device"] for m in s["memory_per_device"]] == ["a100-80g#0", "rtx3090#1", "t4#2"]
    single, ddp, het = data["strategies"]
    assert het["samples_per_s"] > ddp["samples_per_s"] and het["samples_per_s"] > single["samples_per_s"]
    assert data["model"]["params"] == 124_000_000 and data["answers"]


def test_simulate_on_nodes_says_what_the_link_between_them_costs_and_what_fp16_gains():
    import json

    spec = "node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE"
    r = hetrain_here("simulate", "--cluster", spec, "--model", "gpt2-124m")
    assert r.returncode == 0, r.stderr
    assert "between nodes: 2.81 GB/s (25GbE" in r.stdout
    assert "the link between nodes costs" in r.stdout and "fp16 gradient compression" in r.stdout
    j = json.loads(hetrain_here("simulate", "--cluster", spec, "--model", "gpt2-124m", "--json").stdout)
    topo = j["topology"]
    assert [n["devices"] for n in topo["nodes"]] == [2, 4]
    assert topo["sync_s"] > topo["joined_s"] > 0 and topo["net_cost_s"] == pytest.approx(topo["sync_s"] - topo["joined_s"])
    assert topo["fp16"]["exposed_sync_s"] < topo["fp16"]["uncompressed_exposed_sync_s"] and topo["fp16"]["gain"] > 0
    # the whole-cluster link the planner used is the hierarchical all-reduce's
    assert j["link"]["source"].startswith("hierarchical")


def test_simulate_lists():
    r = hetrain_here("simulate", "--list-gpus", "--list-presets")
    assert r.returncode == 0 and "rtx3090" in r.stdout and "llama-1b" in r.stdout and "resnet50" in r.stdout


def test_a_batch_smaller_than_the_devices_runs_as_a_pipeline_not_data_parallel():
    r = hetrain_here("simulate", "--cluster", "a100-80g,rtx3090,t4", "--model", "gpt2-124m", "--global-batch", "2",
                     "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert "global batch 2 is smaller than the 3 devices" in out["data_parallel_error"]
    rows = {row["name"]: row for row in out["layouts"]["rows"]}
    # only TP fits (1F1B over 3 stages needs 3 micro-batches): a default job's auto leaves it out
    # (it turns OOM recovery off), so nothing is recommended and the line says what fits
    assert not rows["DP"]["fits"] and out["layouts"]["best"] is None and rows["TP 3 by speed"]["fits"]
    assert out["layouts"]["left_out"][0].startswith("TP 3 by speed, TP 3 left out: it turns in-loop OOM recovery off")


@pytest.mark.parametrize("args, words", [
    (("simulate", "--cluster", "a100-80g", "--model", "gpt2-124m", "--global-batch", "0"),
     ("--global-batch 0 must be at least 1",)),
    (("simulate", "--cluster", "a100-80g,rtx3090", "--model", "llama-8b", "--offload", "none"),
     ("no layout fits memory", "optimizer-state offload to host memory (--offload plan)")),
    (("simulate", "--cluster", "a100-80g,rtx3090", "--model", "llama-8b", "--offload", "all", "--host-memory", "8GiB"),
     ("--offload all: the optimizer state needs 89.7 GiB of host memory", "--host-memory")),
    (("simulate", "--cluster", "a100-80g,rtx3090", "--model", "llama-8b", "--offload", "sometimes"),
     ("--offload",)),
    (("simulate", "--cluster", "a100-80g,rtx3090", "--model", "llama-8b", "--host-memory", "lots"),
     ("--host-memory",)),
    (("simulate", "--cluster", "a100-80g", "--params", "0", "--flops-per-sample", "1e9", "--activation-bytes", "1e6"),
     ("--params '0' must be a positive number",)),
    (("simulate", "--cluster", "a100-80g", "--params", "1e6", "--flops-per-sample", "-3", "--activation-bytes", "1e6"),
     ("--flops-per-sample '-3' must be a positive number",)),
    (("simulate", "--cluster", "a100-80g", "--params", "1e6", "--flops-per-sample", "1e9", "--activation-bytes", "0"),
     ("--activation-bytes '0'",)),
    (("simulate", "--cluster", "a100-80g", "--params", "1e6"), ("without --flops-per-sample and --activation-bytes",)),
    (("simulate", "--cluster", "a100-80g", "--model", "gpt2-124m", "--global-batch", "0"), ("--global-batch 0",)),
    (("simulate", "--cluster", "a100-80g", "--model", "gpt2-124m", "--global-batch", "-5"), ("--global-batch -5",)),
    (("simulate", "--cluster", "a100-80g,rtx3090", "--model", "gpt2-125m"),
     ("unknown model preset 'gpt2-125m'", "did you mean: gpt2-124m")),
    (("simulate", "--cluster", "a100-80g,rtx-309", "--model", "gpt2-124m"), ("did you mean", "rtx3090")),
    (("simulate", "--model", "gpt2-124m"), ("no cluster given",)),
    (("simulate", "--cluster", "n0=a100-80g; n0=rtx3090; net=25GbE", "--model", "gpt2-124m"),
     ("the node 'n0' is named twice",)),
    (("simulate", "--cluster", "n0=a100-80g; n1=rtx3090; net=25GBq", "--model", "gpt2-124m"),
     ("the unit 'GBq' is not understood",)),
    (("simulate", "--cluster", "n0=a100-80g; n1=rtx3090; net=25GbE", "--model", "gpt2-124m", "--link-gbs", "3"),
     ("--link-gbs with a cluster spec that names its nodes",)),
    (("simulate", "--cluster", "a100-80g", "--model", "gpt2-124m", "--efficiency", "2"), ("--efficiency 2",)),
    (("plan", "--model", "gpt2-124m", "--emulate", "a100-80g,rtx3090", "--global-batch", "0"), ("--global-batch 0",)),
    (("plan", "--model", "gpt2-124m", "--emulate", "a100-80g,rtx3090", "--global-batch", "8", "--micro-batch", "0"),
     ("--micro-batch 0",)),
    (("plan", "--model-factory", "no_such_file.py:make", "--emulate", "a100-80g", "--global-batch", "8"),
     ("does not exist",)),
    (("plan", "--model-factory", "nocolon", "--global-batch", "8"), ("MODULE:FUNCTION",)),
    (("plan", "--model", "gpt2-124m", "--emulate", "a100-80g"), ("no --global-batch given",)),
    (("plan", "--emulate", "a100-80g,rtx3090", "--global-batch", "1", "--model", "resnet50"),
     ("global batch 1 is smaller than the 2 devices",)),
])
def test_bad_input_is_one_line_with_the_fix(args, words):
    one_line_error(hetrain_here(*args), *words)


FACTORY = textwrap.dedent("""
    import torch
    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes

    def make():
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3), ByteWindows(pydoc_bytes()[:50_000], 32)

    def not_a_factory():
        return "a model"

    if __name__ == "__main__":
        raise SystemExit("training would start here; `hetrain plan` must not run it")
""")

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.nn.functional as F
    import hetrain
    sys.path.insert(0, os.path.dirname(__file__))
    from factory import make

    plan_path, out = sys.argv[1], sys.argv[2]
    ht = hetrain.init(global_batch=24, plan=plan_path, max_steps=2, reporting=hetrain.Reporting(verbose=False))
    model, opt, data = make()
    model, opt, batches = ht.prepare(model, opt, data)
    local = []
    for step in batches:
        n = 0
        for mb in step:
            with mb:
                x, y = mb.batch
                n += len(x)
                ht.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        ht.step()
        local.append(n)
    with open(f"{out}.{ht.rank}", "w") as f:
        json.dump({"local": local, "shares": list(ht.plan.shares)}, f)
    ht.close()
""")


ENCODER_FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Classifier(nn.Module):          # a stock encoder no one here wrote
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
            self.head = nn.Linear(32, 2)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)).mean(1))

    def make():
        torch.manual_seed(0)
        data = [(torch.randint(0, 64, (16,)), torch.tensor(i % 2)) for i in range(256)]
        model = Classifier()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), data
""")


def test_plan_ranks_every_layout_for_a_stock_transformer_encoder(tmp_path):
    """The blocks of a stock nn.TransformerEncoder are found without --blocks, so pipelines are
    ranked beside data parallelism and sharding, from the job's own measurements."""
    (tmp_path / "enc.py").write_text(ENCODER_FACTORY)
    # both at speed 1: what is ranked here does not depend on a slower card (the test below checks shares)
    r = hetrain("plan", "--model-factory", f"{tmp_path / 'enc.py'}:make", "--emulate", "a100-80g:1.0,rtx3090:1.0",
                "--global-batch", "16")
    assert r.returncode == 0, r.stderr
    assert "4 TransformerEncoderLayer in 'encoder.layers'" in r.stdout + r.stderr
    for layout in ("DP:", "DP + ZeRO-1:", "DP + capacity:", "FSDP2:", "PP 2 stages:"):
        assert f"  {layout}" in r.stdout, r.stdout
    # its attention's fused q/k/v projection cannot be split: TP is not offered, with the runtime's reason
    assert "  TP not offered: tensor parallelism cannot split this Classifier" in r.stdout, r.stdout
    assert "best layout: " in r.stdout and "blocks unknown" not in r.stdout
    # FSDP2's step beside DDP's, timed in the job's processes (runtime/measure/fsdp_probe.py)
    assert "FSDP2 measured: a step" in r.stdout + r.stderr and "measured here: +" in r.stdout


def test_plan_writes_the_runtimes_plan_and_the_runtime_runs_it(tmp_path):
    """`hetrain plan` measures in the job's processes as the runtime does; the plan it writes is,
    field for field, the one the runtime's planner makes from those measurements under the config
    `hetrain.init(global_batch=24)` gets from `hetrain run --emulate SPEC`; the runtime runs it."""
    (tmp_path / "factory.py").write_text(FACTORY)
    (tmp_path / "worker.py").write_text(WORKER)
    spec = "a100-80g:1.0,rtx3090:0.5"
    plan_file, measured_file = tmp_path / "plan.json", tmp_path / "measured.json"
    r = hetrain("plan", "--model-factory", f"{tmp_path / 'factory.py'}:make", "--emulate", spec,
                "--global-batch", "24", "--out", str(plan_file), "--measurements", str(measured_file))
    assert r.returncode == 0, r.stderr
    assert "rank 1: share" in r.stdout and f"wrote {plan_file}" in r.stdout and "plain DDP" in r.stdout
    assert "launching 2 process(es)" in r.stderr and "0 of 2 from the cache" in r.stderr
    plan = Plan.from_json(plan_file.read_text())
    assert plan.world_size == 2 and plan.global_batch == 24 and plan.shares[0] > plan.shares[1]
    assert plan.predicted["samples_per_s"] > 0
    measured = Measurements.from_json(measured_file.read_text())
    assert measured.world_size == 2 and len(measured.sync_s) == 2 and measured.agree_s   # the probes ran
    # on gloo, the sync probe's runs that also give the stragglers and the contention: every rank's
    assert {len(runs) for runs in measured.sync_s + measured.compute_s} == {sync_runs("gloo")} != {SYNC_RUNS}
    runtime_plan, _ = plan_from_measurements(measured, Config(global_batch=24, emulation=Emulation(cluster=spec)))
    assert plan == runtime_plan                               # every field, every device's
    assert all(d.per_sample_s and d.fixed_s is not None for d in plan.devices)   # the rebalancer's model too
    # the pipeline's blocks and how much longer a stage runs them, timed on each rank
    # (runtime/layouts/pipeline/probe.py), kept for the job that follows (runtime/layouts/pipeline/block_cache.py)
    assert re.search(r"pipeline blocks measured: .*a stage runs them x[\d.]+ \+ [\d.]+ ms a block", r.stdout + r.stderr), \
        r.stderr
    assert measured.pipeline["profile"]["block_s"] > 0

    again = hetrain("plan", "--model-factory", f"{tmp_path / 'factory.py'}:make", "--emulate", spec,
                    "--global-batch", "24", "--json", "--measurements", str(tmp_path / "again.json"))
    assert again.returncode == 0 and "2 of 2 from the cache" in again.stderr   # measured once, reused
    assert Measurements.from_json((tmp_path / "again.json").read_text()).profiles == measured.profiles
    again_pipeline = Measurements.from_json((tmp_path / "again.json").read_text()).pipeline["profile"]
    assert again_pipeline["source"].endswith("(cached)")
    assert again_pipeline["blocks"] == measured.pipeline["profile"]["blocks"]
    assert Plan.from_json(again.stdout).world_size == 2        # stdout is the plan alone

    out = tmp_path / "ran"
    run = hetrain("run", "--emulate", spec, str(tmp_path / "worker.py"), str(plan_file), str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"ran.{rank}").read_text())
        assert got["shares"] == list(plan.shares) and got["local"] == [plan.shares[rank]] * 2


@pytest.mark.parametrize("factory, extra, words, launched", [
    ("make", ("--out", "{tmp}/missing/plan.json"), ("--out", "does not exist"), False),
    ("nomake", (), ("has no function 'nomake'",), False),
    ("make", ("--measurements", "{tmp}/missing/m.json"), ("--measurements", "does not exist"), False),
    ("not_a_factory", (), ("returned str",), True),        # found in the worker: one line all the same
])
def test_a_bad_factory_or_path_is_one_line(tmp_path, factory, extra, words, launched):
    (tmp_path / "factory.py").write_text(FACTORY)
    command = hetrain if launched else hetrain_here        # refused before any process starts: in this one
    r = command("plan", "--model-factory", f"{tmp_path / 'factory.py'}:{factory}", "--emulate", "a100-80g",
                "--global-batch", "8", *(e.format(tmp=tmp_path) for e in extra))
    one_line_error(r, *words)
    assert ("launching" in r.stderr) == launched              # paths and the factory are checked first


def test_plan_from_a_preset_without_measuring(tmp_path):
    # 400 MiB, 10% kept free, holds less than resnet50's 390 MiB of model state: no sample fits
    r = hetrain_here("plan", "--model", "resnet50", "--emulate", "a100-80g,rtx3090,t4@400MiB", "--global-batch", "64",
                "--allow-exclusion", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json((tmp_path / "p.json").read_text())
    assert [d.device for d in plan.devices] == ["a100-80g#0", "rtx3090#1"]
    assert plan.excluded[0].device == "t4#2" and "left out t4#2" in r.stdout
    assert "launch it on the devices kept: hetrain run --emulate a100-80g:1@" in r.stdout
    assert ",rtx3090:" in r.stdout and "t4:" not in r.stdout


def test_plan_checkpoints_where_one_sample_needs_it_as_the_runtime_may(tmp_path):
    """512 MiB holds the model state and one sample only with activation checkpointing: the
    config's default (checkpointing='plan') lets the plan turn it on; 'none' does not."""
    args = ("plan", "--model", "resnet50", "--emulate", "a100-80g,rtx3090,t4@512MiB", "--global-batch", "64",
            "--allow-exclusion", "--json")
    plan = Plan.from_json(hetrain_here(*args).stdout)
    assert [d.checkpointing for d in plan.devices] == [False, False, True] and not plan.excluded
    plan = Plan.from_json(hetrain_here(*args, "--checkpointing", "none").stdout)
    assert [d.device for d in plan.devices] == ["a100-80g#0", "rtx3090#1"] and plan.excluded[0].kind == "memory"


def test_plan_compares_data_parallel_pipeline_and_hybrid_layouts():
    """Four devices, a 12-layer model: DP, PP over 4 stages and DP×PP 2×2 are each predicted and
    one is picked with the reason; a model too big for any one device leaves DP out."""
    result = hetrain_here("plan", "--model", "gpt2-124m", "--emulate", "a100-80g,a100-80g,rtx3090,rtx3090",
                     "--global-batch", "32")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "best layout: " in out and "run it: " in out
    for layout in ("DP:", "DP + ZeRO-1:", "DP + capacity:", "FSDP2:", "PP 4 stages:", "DP×PP 2×2:", "TP 4:"):
        assert f"  {layout}" in out, out
    result = hetrain_here("plan", "--params", "20e9", "--flops-per-sample", "1e13", "--activation-bytes", "1GiB",
                     "--blocks", "40", "--emulate", "a100-80g,a100-80g", "--global-batch", "8")
    # 20B parameters with AdamW state do not fit one 80 GB card: whatever the plan says, DP cannot be it
    text = result.stdout + result.stderr
    assert "does not fit" in text or "fits nowhere" in text or "no device" in text, text


def test_simulate_fits_llama_8b_with_the_memory_savers_and_says_which_each_device_uses():
    r = hetrain_here("simulate", "--cluster", "2xa100-80g,2xrtx3090", "--model", "llama-8b", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    layouts = json.loads(r.stdout)["layouts"]
    best = next(row for row in layouts["rows"] if row["name"] == layouts["best"])
    assert best["family"] in ("FSDP2", "capacity-full") and best["fits"]
    assert all(m <= cap for m, cap in zip(best["memory"], layouts["capacity"]))
    assert "optim on host" in best["savers"][2] and "savers:" in best["detail"]
    shown = hetrain_here("simulate", "--cluster", "2xa100-80g,2xrtx3090", "--model", "llama-8b").stdout
    assert "optim on host" in shown and "ckpt " in shown and "/32" in shown
    # the savers turned off: nothing fits again, and the advice names them first
    off = hetrain_here("simulate", "--cluster", "2xa100-80g,2xrtx3090", "--model", "llama-8b", "--offload", "none")
    assert off.returncode == 2 and "fix: optimizer-state offload to host memory (--offload plan)" in off.stderr
    bare = hetrain_here("simulate", "--cluster", "2xa100-80g,2xrtx3090", "--model", "llama-8b", "--checkpointing", "none")
    assert bare.returncode == 2 and "fix: activation checkpointing (--checkpointing plan)" in bare.stderr


def test_plan_takes_the_host_memory_and_refuses_an_offload_it_has_no_room_for():
    args = ("plan", "--model", "llama-8b", "--emulate", "2xa100-80g,2xrtx3090", "--global-batch", "256",
            "--precision", "bf16")
    r = hetrain_here(*args, "--host-memory", "256GiB")
    assert "optim on host" in r.stdout and "FSDP2" in r.stdout
    one_line_error(hetrain_here(*args, "--offload", "all", "--host-memory", "1GiB"),
                   "--offload all: the optimizer state needs", "--host-memory")
