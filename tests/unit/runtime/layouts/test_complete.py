"""A layout's plan made complete before anything is built (runtime/layouts/complete.py): every
record the build used to add (precision, checkpointing, offload, the compression the wrapper runs,
the islands note) is in the plan it adopts; the re-plan completes a new plan the same way; the build
refuses, as hetrain's bug, a plan that does not say what runs."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hetrain.errors import HetrainError, UsageError
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.runtime import replan
from hetrain.runtime.job import RunState
from hetrain.runtime.layouts import complete as completing
from hetrain.runtime.layouts.complete import check_built, complete
from hetrain.runtime.memory import offload
from hetrain.runtime.memory.activation_checkpointing import applied_for_now, is_checkpointed
from hetrain.runtime.sharding import comm_hooks


def a_plan(**changes) -> Plan:
    changes.setdefault("devices", [DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=8, micro_batch=4)
                                   for r in range(2)])
    return Plan(global_batch=16, layout_spec={"kind": "DataParallel", "sharding": None}, **changes)


class Precision:
    """The job's agreed precision: rank 1 runs bf16."""

    def record_in(self, plan):
        return replace(plan, devices=(plan.devices[0], replace(plan.devices[1], precision="bf16")))


class FakeJob(SimpleNamespace):
    plan = property(lambda self: self.run.plan)
    plan_seal = property(lambda self: self.run.plan_seal)


def a_job(*, checkpointing="plan", offloading="auto", compression="auto", backend="gloo"):
    memory = SimpleNamespace(activation_checkpointing=checkpointing, blocks=None, offload_optimizer=offloading)
    return FakeJob(world_size=2, rank=0, precision=Precision(), ctx=SimpleNamespace(backend=backend),
                   config=SimpleNamespace(global_batch=16, memory=memory,
                                          compression=SimpleNamespace(method=compression)),
                   nodes=SimpleNamespace(islands=None), emulated=None, memory_plan=None, run=RunState())


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_the_plan_holds_every_record_and_keeps_its_version():
    job, plan = a_job(checkpointing="all", offloading="always"), a_plan(version=3, compression="fp16")
    done = complete(job, Blocks(), plan, sharding=lambda p: "none")
    assert done.version == 3 and done.compression == "fp16"
    assert [d.precision for d in done.devices] == ["fp32", "bf16"]
    assert all(d.checkpointing and d.checkpoint_blocks is None for d in done.devices)
    assert all(d.offload_optimizer for d in done.devices)
    # complete: completing it again changes nothing (a resumed plan's records are re-derived alike)
    assert complete(job, Blocks(), done, sharding=lambda p: "none") == done


def test_the_sharding_is_asked_of_the_plan_with_its_other_records_and_decides_the_compression():
    seen = []

    def sharding(p):
        seen.append(p)
        return "fsdp"
    done = complete(a_job(checkpointing="all"), Blocks(), a_plan(compression="powersgd"), sharding=sharding)
    assert seen[0].devices[1].precision == "bf16" and seen[0].devices[0].checkpointing
    assert done.compression == "none" and "the planner chose sharding fsdp" in done.note
    # an explicit request the chosen sharding cannot run is refused, in one line
    with pytest.raises(UsageError, match="sharding 'fsdp'") as e:
        complete(a_job(compression="fp16"), Blocks(), a_plan(), sharding=lambda p: "fsdp")
    assert "\n" not in str(e.value)
    # asked for on plain data parallelism: recorded in the plan
    assert complete(a_job(compression="fp16"), Blocks(), a_plan(), sharding=lambda p: "none").compression == "fp16"
    # no DDP all-reduce here (tp, pipeline): the layout's compression stays
    assert complete(a_job(compression="fp16"), Blocks(), a_plan(), sharding=None).compression == "none"


def test_islands_record_no_compression_with_the_reason(monkeypatch):
    from hetrain.runtime.ranks import islands

    monkeypatch.setattr(islands, "for_job", lambda job: object())
    done = complete(a_job(), Blocks(), a_plan(compression="fp16", note="slow link"), sharding=lambda p: "none")
    assert done.compression == "none"
    assert done.note == "slow link; gradient compression none: fp16 is not run by the hierarchical all-reduce across islands"
    # asked for explicitly: still none across islands, and the build's check (data_setup.install)
    # finds the plan says what runs: the wrapper's compression, then the islands' none
    job = a_job(compression="fp16")
    asked = complete(job, Blocks(), a_plan(), sharding=lambda p: "none")
    assert asked.compression == "none" and "fp16 is not run by the hierarchical all-reduce" in asked.note
    assert completing.across_islands(job, comm_hooks.settle(asked, request="fp16", strategy="none", backend="gloo",
                                                            world_size=2)) == asked
    assert complete(job, Blocks(), asked, sharding=lambda p: "none") == asked     # completed again: said once
    monkeypatch.setattr(islands, "for_job", lambda job: None)
    assert complete(a_job(), Blocks(), a_plan(compression="fp16"), sharding=lambda p: "none").compression == "fp16"


def test_records_that_cannot_run_are_refused_when_the_plan_is_completed():
    needing = a_plan(devices=(DevicePlan(rank=0, device="cpu0", speed=1.0, share=8, micro_batch=4,
                                         offload_optimizer=True),
                              DevicePlan(rank=1, device="cpu1", speed=1.0, share=8, micro_batch=4)))
    with pytest.raises(UsageError, match="offload_optimizer='never'"):
        complete(a_job(offloading="never"), Blocks(), needing)
    with pytest.raises(UsageError, match="no blocks to checkpoint"):
        complete(a_job(checkpointing="all"), torch.nn.Linear(2, 2), a_plan())
    # after prepare (no model): the blocks were checked then
    assert complete(a_job(checkpointing="all"), None, a_plan()).devices[0].checkpointing


def test_a_built_wrapper_that_differs_from_the_plan_is_hetrains_bug():
    check_built(a_plan(), predicted="fsdp", built="fsdp")
    with pytest.raises(HetrainError, match="wrapped under sharding 'zero1', but the plan in force .v0. was completed "
                                           "for sharding 'none'") as e:
        check_built(a_plan(), predicted="none", built="zero1")
    assert e.value.fix == completing.BUG


def test_offload_applies_only_a_plan_that_records_it():
    job = a_job(offloading="always")
    replan.adopt(job, a_plan(), "planned")          # not completed: the offload 'always' runs is not in it
    with pytest.raises(HetrainError, match="does not record the optimizer offload"):
        offload.apply(job, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), "none")


def test_a_resumed_plan_is_completed_on_this_job_and_one_made_in_training_keeps_what_was_built():
    job = a_job(checkpointing="all")
    layout_completion = []

    def completed(p):
        layout_completion.append(p)
        return complete(job, Blocks(), p, sharding=lambda _: "fsdp")
    saved = a_plan(version=4, compression="fp16")          # a checkpoint's, from another run
    made = replan.replan(job, saved, "resumed", complete=completed)
    assert layout_completion == [saved] and job.plan is made and made.version == 4
    assert made.devices[1].precision == "bf16" and all(d.checkpointing for d in made.devices)
    assert made.compression == "none"                     # this job's wrapper runs fsdp
    # during training: shares and micro-batches move, the records stay (checked)
    moved = made.evolve(note="rebalanced", devices=tuple(replace(d, share=s) for d, s in zip(made.devices, (10, 6))))
    assert replan.replan(job, moved, "rebalanced") is moved and job.plan is moved
    for change in (dict(precision="fp16"), dict(checkpointing=False), dict(offload_optimizer=True)):
        bad = moved.evolve(note="OOM", devices=(replace(moved.devices[0], **change), moved.devices[1]))
        with pytest.raises(HetrainError, match=f"the OOM plan v6 changes what was built .*rank 0 {next(iter(change))}"):
            replan.replan(job, bad, "OOM")
    with pytest.raises(HetrainError, match="compression 'none' -> 'fp16'"):
        replan.replan(job, moved.evolve(note="x", compression="fp16"), "rebalanced")
    assert job.plan is moved


def test_checkpointing_put_on_for_a_measurement_is_taken_off_after_it():
    model = Blocks()
    plan = a_plan(devices=(DevicePlan(rank=0, device="cpu0", speed=1.0, share=8, micro_batch=4,
                                      checkpointing=True, checkpoint_blocks=2),
                           DevicePlan(rank=1, device="cpu1", speed=1.0, share=8, micro_batch=4)))
    x = torch.randn(3, 2)
    before = model(x)
    with applied_for_now(model, plan, 0):
        assert [is_checkpointed(b) for b in model.blocks] == [True, True, False]
        assert torch.equal(model(x), before)
    assert not any(is_checkpointed(b) for b in model.blocks)
    assert all("forward" not in vars(b) for b in model.blocks)
    with applied_for_now(model, plan, 1):                  # rank 1 checkpoints nothing
        assert not any(is_checkpointed(b) for b in model.blocks)
