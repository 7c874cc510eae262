"""The one chooser (planning/chooser.py): what parallel='auto', `hetrain plan`, Pipeline(stages='auto')
and sharding='auto' run, each case against a reference worked out by hand or by the planner's own
pieces (split_hybrid, stretched_step, allreduce_seconds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetrain import DataParallel, Pipeline, TensorParallel
from hetrain.layout_spec import to_spec
from hetrain.planning.chooser import Request, choose, spec_of
from hetrain.planning.collectives import allreduce_seconds
from hetrain.emulation.sharing import SharedHost, stretched_step
from hetrain.planning.memory import AUTO_SHARDINGS, DeviceMemory, choose_sharding, sharding_options
from hetrain.planning.options import PlanOptions, ring_link
from hetrain.planning.parallelism import split_hybrid, stage_rows
from hetrain.runtime.layouts.pipeline.split import PipelineProfile, StageDevice
from hetrain.planning.profile import DeviceProfile
from hetrain.planning.ranking import LayoutRow, ModelState, rank_layouts
from hetrain.runtime.layouts.tensor.split import tp_comm_ratio


def row(name, family, sps, *, fits=True, stages=None):
    r = LayoutRow(name=name, family=family, fits=fits, samples_per_s=sps if fits else 0.0, memory=(None, None),
                  comm_bytes=0.0, comm_s=0.0, detail=f"{name} detail", run=f"run {name}", stages=stages)
    from dataclasses import replace

    return replace(r, spec=spec_of(r))


def table():
    return [row("DP", "DP", 100.0), row("DP + ZeRO-1", "DP + ZeRO-1", 103.0), row("FSDP2", "FSDP2", 90.0),
            row("capacity-full", "capacity-full", 120.0), row("PP 2 stages", "PP", 104.0, stages=2),
            row("TP 2 by speed", "TP by speed", 400.0)]


def test_auto_runs_the_fastest_allowed_or_a_simpler_one_within_5_percent():
    c = choose(table())
    assert c.row.name == "DP" and c.spec == to_spec(DataParallel(sharding="none"))   # 104 is within 5% of 100
    assert "within 5% of the fastest (PP 2 stages, 104.0)" in c.why
    faster = [row("DP", "DP", 100.0), row("PP 2 stages", "PP", 106.0, stages=2)]       # 6% faster: it runs
    assert choose(faster).row.name == "PP 2 stages"
    assert choose(faster, Request(within=0.1)).row.name == "DP"


def test_an_explicit_layout_is_never_overridden():
    rows = table()
    for asked in (DataParallel(sharding="zero1"), Pipeline(stages=2), TensorParallel()):
        c = choose(rows, Request(layout=asked))
        assert c.spec == to_spec(asked)
        assert f"{asked!r} asked for by name: it runs as asked" in c.why and "auto would run DP" in c.why
    assert choose(rows, Request(layout=DataParallel(sharding="zero1"))).row.name == "DP + ZeRO-1"


def test_prepare_returns_an_explicit_layout_without_ranking():
    from hetrain.runtime.layouts.choose import decide

    for asked in (DataParallel(sharding="zero1"), Pipeline(stages=2)):
        # no job, model or optimizer: an explicit layout measures nothing and ranks nothing
        assert decide(None, asked, None, None, None, None) == (asked, None)


def test_without_loss_fn_the_pipelines_are_left_out_in_one_line():
    rows = [row("DP", "DP", 100.0), row("PP 2 stages", "PP", 200.0, stages=2), row("DP×PP 2×2", "DP×PP", 150.0,
                                                                                   stages=2)]
    c = choose(rows, Request(has_loss_fn=False))
    assert c.row.name == "DP"
    assert c.left_out == ("PP 2 stages, DP×PP 2×2 left out: no loss_fn: a pipeline's schedule computes the loss on "
                          "the last stage (pass loss_fn= to ht.prepare())",)
    assert choose(rows).row.name == "PP 2 stages" and choose(rows).left_out == ()


def test_oom_recovery_rules_out_capacity_full_and_tp_and_without_it_tp_may_win():
    c = choose(table())                                    # the default job keeps in-loop OOM recovery on
    assert c.row.family == "DP"
    assert any(line.startswith("capacity-full, TP 2 by speed left out: it turns in-loop OOM recovery off")
               for line in c.left_out)
    off = choose(table(), Request(oom_recovery=False))
    assert off.row.name == "TP 2 by speed" and off.spec == to_spec(TensorParallel(split="speed"))
    only = choose([row("DP", "DP", 0.0, fits=False), row("TP 2", "TP", 50.0)])
    assert only.row is None and only.why.startswith("only layouts left out fit memory")


def test_a_family_constraint_chooses_among_its_rows():
    assert choose(table(), Request(families=("FSDP2", "DP + ZeRO-1"))).row.name == "DP + ZeRO-1"
    assert choose(table(), Request(families=("PP",))).row.name == "PP 2 stages"
    none = choose(table() + [row("DP×PP 2×2", "DP×PP", 0.0, fits=False, stages=2)], Request(families=("DP×PP",)))
    assert none.row is None and none.why == "none of the layouts asked for fits memory" and none.left_out == ()


@pytest.mark.parametrize("params", [2e8, 1e9, 1.5e9, 2.4e9, 3e9])
def test_sharding_auto_is_the_simplest_sharding_that_fits(params):
    devices = [DeviceMemory(label="a100", capacity=72e9, activations=4e9),
               DeviceMemory(label="rtx3090", capacity=21.6e9, activations=2e9)]
    options = sharding_options(int(params), devices)
    reference = next((o for o in options if o.fits(devices)), None)          # AUTO_SHARDINGS' order
    assert [o.strategy for o in options] == list(AUTO_SHARDINGS)
    if reference is None:
        with pytest.raises(Exception, match="does not fit under any sharding"):
            choose_sharding(options, devices)
    else:
        assert choose_sharding(options, devices)[0] is reference


def test_pipeline_stages_auto_counts_the_shared_cores_as_the_ranking_does():
    profile = PipelineProfile.uniform(n_blocks=8, seconds_per_sample=0.01, activation_bytes_per_sample=1e6,
                                      param_bytes=1e6)
    devices = [StageDevice(name=f"d{i}", speed=s) for i, s in enumerate([1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5])]

    def split(p):
        return split_hybrid(profile, devices, stages=p, global_batch=64, micro_batches=8, schedule="1f1b",
                            state_factor=4.0, memory_margin=0.1)

    alone = stage_rows(profile, devices, PlanOptions(global_batch=64), micro_batches=lambda p: 8, schedule="1f1b",
                       state_factor=4.0)
    assert [(r.name, r.spec) for r in alone] == [("DP×PP 4×2", to_spec(Pipeline(stages=2))),
                                                 ("DP×PP 2×4", to_spec(Pipeline(stages=4)))]
    for r in alone:
        assert r.samples_per_s == pytest.approx(split(r.stages).samples_per_s)
    shared = stage_rows(profile, devices, PlanOptions(global_batch=64), micro_batches=lambda p: 8,
                        schedule="1f1b", state_factor=4.0, host=SharedHost(cores=2.0))
    for r in shared:
        h = split(r.stages)
        step, _ = stretched_step(h.replicas, cores=2.0)
        assert r.samples_per_s == pytest.approx(64 / step) and r.samples_per_s < h.samples_per_s
    best = choose(shared, Request(families=("DP×PP",))).row
    assert best.samples_per_s >= max(r.samples_per_s for r in shared) * 0.95


# -- tensor parallelism on a model that is no transformer --------------------------------------
def mlp_profiles():
    """The emulated pair of a small MLP: a 1 ms fixed part a micro-batch against 2 µs a sample."""
    return [DeviceProfile(device=f"dev{i}", source="given", overhead_s=0.001, per_sample_s=2e-6 / s,
                          fixed_bytes=4000, activation_bytes_per_sample=400.0) for i, s in enumerate([1.0, 0.5])]


def test_tp_is_not_offered_for_a_two_layer_mlp_it_cannot_split():
    from hetrain.runtime.layouts.ranking import tp_facts

    facts = tp_facts(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)))
    assert facts["tp_refused"].startswith("tensor parallelism cannot split this Sequential: found 3 blocks")
    state = ModelState(params=8 * 32 * 2 + 40, trainable=8 * 32 * 2 + 40, **facts)
    ranking = rank_layouts(mlp_profiles(), state=state, options=PlanOptions(global_batch=32),
                           request=Request(oom_recovery=False))
    assert not [r for r in ranking.rows if r.family.startswith("TP")]
    assert ranking.not_offered.startswith("TP not offered: tensor parallelism cannot split this Sequential")
    assert ranking.best.family == "DP"


def test_tp_of_mlp_blocks_all_reduces_by_their_widths_and_pays_each_micro_batchs_fixed_part():
    from hetrain.runtime.layouts.ranking import tp_facts

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    facts = tp_facts(nn.Sequential(Block(), Block()))
    ratio = (2 * 8 + 2 * 8) / (2 * (2 * 8 + 2 * 32))     # each pair: d forward + d backward of 2d + 2h kept
    assert facts == {"tp_comm_per_activation": pytest.approx(ratio), "tp_pairs": 2}
    assert tp_comm_ratio([("mlp", 8, 32)]) == ratio
    profiles = mlp_profiles()
    agree = 1e-4                                          # a small all-reduce on these ranks, as measured
    options = PlanOptions(global_batch=32, agree_s=agree)
    ranking = rank_layouts(profiles, state=ModelState(params=1100, trainable=1100, **facts), options=options,
                           request=Request(oom_recovery=False))
    speed = next(r for r in ranking.rows if r.family == "TP by speed")
    # 2 pairs, an all-reduce each forward and backward: 4 calls, each at least the measured small one
    call = max(agree, allreduce_seconds(2, 32 * ratio * 400.0 / 4, ring_link(profiles, options)))
    assert speed.comm_s == pytest.approx(4 * call)
    # Each shard runs every layer of the one micro-batch, so its 1 ms is paid whole: the split by
    # speed cannot beat data parallelism's shares by 4x as the transformer model once claimed.
    step = 0.001 + 2 / 3 * 32 * 2e-6 + 4 * call
    assert 32 / speed.samples_per_s == pytest.approx(step, rel=1e-6)
    dp = next(r for r in ranking.rows if r.family == "DP")
    assert speed.samples_per_s < dp.samples_per_s
