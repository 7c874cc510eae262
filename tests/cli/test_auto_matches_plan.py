"""prepare(parallel='auto') runs the layout `hetrain plan --model-factory` recommends: both measure
with runtime/layouts/ranking.measure_for_ranking and rank with measurements.rank_job_measurements.
Two cases run both commands, with a clear winner so timing noise cannot flip them: a small device
that plain data parallelism (and every sharding) does not fit, where only the pipeline does; and
roomy devices, where plain DP is the fastest of the layouts auto may run and the simplest. Then,
on given measurements (no timing), every layout family is the answer of one case, and auto
(choose.auto_layout, what prepare() runs) and `hetrain plan` (rank_job_measurements, what it
prints) give it alike: memory decides among the data-parallel rows (they tie on a fast link, so
the simplest that fits wins), blocks and a small device make the pipelines win, a slow link
and OOM recovery off make tensor parallelism win (the split by speed timed, as both time it)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from clirun import hetrain, hetrain_here
from hetrain import DataParallel, Pipeline, TensorParallel
from hetrain.layout_spec import from_spec
from hetrain.planning.profile import DeviceProfile
from hetrain.runtime.config import Config
from hetrain.runtime.config_groups import Memory
from hetrain.runtime.layouts.choose import auto_layout
from hetrain.runtime.measure.measurements import Measurements, rank_job_measurements

FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*(Residual(6) for _ in range(4))).double()
        g = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g).double(),
                                              torch.randn(96, 6, generator=g).double())
        return model, torch.optim.SGD(model.parameters(), lr=0.1), data
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.nn.functional as F
    import hetrain
    sys.path.insert(0, os.path.dirname(__file__))
    from factory import make

    global_batch, out = int(sys.argv[1]), sys.argv[2]
    ht = hetrain.init(global_batch=global_batch, max_steps=1)
    said, original = [], ht.job.log.info
    ht.job.log.info = lambda m: (said.append(m), original(m))
    model, opt, data = make()
    model, opt, batches = ht.prepare(model, opt, data, parallel="auto", loss_fn=F.mse_loss)
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
    if ht.is_main:
        with open(out, "w") as f:
            json.dump({"layout": ht.plan.layout, "said": [m for m in said if "parallel=auto chose" in m]}, f)
    ht.close()
""")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path / "cache"))


def capped_spec() -> str:
    """The whole SGD state of the factory's model fits 1.6× on the big device, 0.48× on the small one."""
    from hetrain.planning.memory import state_factor

    params = 4 * (6 * 6 + 6) * 8                       # 4 Linear(6, 6), float64
    big = int(state_factor("sgd") * params * 1.6)
    return f"a100-80g@{big}B,rtx3090@{int(big * 24 / 80)}B"


@pytest.mark.parametrize("case", ["capped", "roomy"])
def test_auto_runs_the_layout_hetrain_plan_recommends(tmp_path, case):
    (tmp_path / "factory.py").write_text(FACTORY)
    (tmp_path / "script.py").write_text(SCRIPT)
    spec, batch, expected = {"capped": (capped_spec(), "12", ("PP 2 stages", "pp")),
                             "roomy": ("a100-80g,rtx3090", "48", ("DP", "dp"))}[case]
    plan = hetrain("plan", "--model-factory", f"{tmp_path / 'factory.py'}:make", "--emulate", spec,
                   "--global-batch", batch)
    said = plan.stdout + plan.stderr
    # plain DP fits: the plan, the ranking, "best layout: NAME: ..."; it does not: exit 2 naming the best
    found = re.search(r"best layout(?: that does)?: ([^:,]+)[:,]", said)
    assert found, said[-3000:]
    recommended = found.group(1).strip()
    run = hetrain("run", "--verbose", "--emulate", spec, str(tmp_path / "script.py"), batch,   # auto's choice said
                  str(tmp_path / "out.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    chose = re.search(r"parallel=auto chose (\w+\(.*?\)): ([^:]+):", got["said"][0])
    assert chose, got
    assert chose.group(2) == recommended == expected[0], (got["said"], said[-2000:])
    assert got["layout"] == expected[1]
    from hetrain import DataParallel, Pipeline
    assert chose.group(1) == repr({"pp": Pipeline(), "dp": DataParallel(sharding="none")}[expected[1]])


# -- every family, on given measurements ------------------------------------------------------
P, MB = 1_000_000, 1e6          # a model of 1M fp32 parameters under AdamW: 16 MB of state, 4 MB of gradients


def given(speeds, memory, *, link_s=1e-4, act=0.1 * MB, tp=None) -> Measurements:
    """What the ranks would have measured: 2 ms a sample at speed 1, a gradient all-reduce (and
    the exposed sync) of `link_s` seconds; `tp`: the split by speed's timed step."""
    n = len(speeds)
    profiles = tuple(DeviceProfile(device=f"d{i}", source="given", overhead_s=5e-4, per_sample_s=0.002 / v,
                                   fixed_bytes=16 * P, activation_bytes_per_sample=act,
                                   memory_bytes=None if m is None else int(m))
                     for i, (v, m) in enumerate(zip(speeds, memory)))
    return Measurements(labels=tuple(p.device for p in profiles), precisions=("fp32",) * n, profiles=profiles,
                        grad_bytes=4 * P, cpu_cores=16, allreduce_s=(link_s,) * n, sync_s=((link_s,) * 3,) * n,
                        compute_s=((0.0,) * 3,) * n, agree_s=(1e-4,) * n, probe_size=4, tp=tp)


def facts(blocks=None) -> dict:
    return {"params": P, "trainable": P, "param_bytes": 4, "frozen_param_bytes": 4, "optimizer": "adamw",
            "blocks": blocks, "root_params": 0}


TIMED_TP = {"fb_s": 0.02, "opt_s": 0.001, "micro_batch": 32, "runs": 3}
FAMILIES = {   # family: (measurements, blocks, OOM recovery, the layout object that runs)
    "DP": (given([1, 0.5], [None, None]), None, True, DataParallel(sharding="none")),
    "DP + ZeRO-1": (given([1, 0.5], [40 * MB, 16 * MB]), None, True, DataParallel(sharding="zero1")),
    "DP + capacity": (given([1, 0.5], [40 * MB, 12 * MB]), None, True, DataParallel(sharding="capacity")),
    "FSDP2": (given([1, 1], [11 * MB, 11 * MB], act=0.01 * MB), 8, True, DataParallel(sharding="fsdp")),
    "capacity-full": (given([1, 0.5], [40 * MB, 7 * MB]), 4, False, DataParallel(sharding="capacity-full")),
    "PP": (given([1, 0.5], [40 * MB, 7 * MB]), 4, True, Pipeline()),
    "DP×PP": (given([1, 0.5, 1, 0.5], [40 * MB, 6 * MB] * 2), 4, True, Pipeline(stages=2)),   # 6 MB: FSDP2 does not fit
    "TP": (given([1, 1], [None, None], link_s=0.5), None, False, TensorParallel()),
    "TP by speed": (given([1, 0.5], [None, None], link_s=0.5, tp=TIMED_TP), None, False,
                    TensorParallel(split="speed")),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_and_hetrain_plan_choose_every_family_alike(family):
    measured, blocks, oom_recovery, layout = FAMILIES[family]
    config = Config(global_batch=32, memory=Memory(oom_recovery=oom_recovery))
    plan = rank_job_measurements(measured, config, facts=facts(blocks), blocks=blocks)[0]    # cli/planning.plan's
    auto, ranked = auto_layout(measured, config, facts=facts(blocks), blocks=blocks, has_loss_fn=True)
    assert plan.best.family == family, plan.why
    assert auto == from_spec(plan.best.spec) == layout
    assert ranked.best == plan.best and ranked.why == plan.why
    if family == "TP by speed":         # the timed step, in both
        assert "a step measured here" in plan.best.detail


def test_without_loss_fn_auto_leaves_the_pipelines_out_and_says_so():
    measured, blocks, _, _ = FAMILIES["DP×PP"]
    config = Config(global_batch=32)
    auto, ranked = auto_layout(measured, config, facts=facts(blocks), blocks=blocks, has_loss_fn=False)
    # capacity-full fits too, but it turns OOM recovery off: nothing auto may run fits, so plain
    # DataParallel() runs and its own plan says why
    assert auto == DataParallel() and ranked.best is None
    assert [line for line in ranked.left_out if "loss_fn" in line] == [
        "DP×PP 2×2, PP 4 stages left out: no loss_fn: a pipeline's schedule computes the loss on the last stage "
        "(pass loss_fn= to ht.prepare())"]


def test_hetrain_plan_follows_the_jobs_oom_recovery_as_auto_does():
    """A 1B-parameter model on a 1 GB/s link: the gradient all-reduce dwarfs TP's activation
    all-reduces, so TP by speed predicts the most. With OOM recovery on (the default) `hetrain plan`
    recommends what auto would run and says in one line what it left out; --no-oom-recovery, as
    Memory(oom_recovery=False), lets it recommend TP."""
    args = ("plan", "--params", "1e9", "--flops-per-sample", "6e9", "--activation-bytes", "1MiB", "--emulate",
            "a100-80g,rtx3090", "--global-batch", "32", "--link-gbs", "1")
    on, off = hetrain_here(*args), hetrain_here(*args, "--no-oom-recovery")     # from figures: no process starts
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert "best layout: DP: " in on.stdout and "TP 2 by speed predicts" in on.stdout
    assert "  TP 2 by speed, TP 2, capacity-full left out: it turns in-loop OOM recovery off" in on.stdout
    assert "best layout: TP 2 by speed: " in off.stdout
    assert "run it: ht.prepare(..., parallel=hetrain.TensorParallel(split='speed'))" in off.stdout
