"""Lightning Fabric on hetrain (hetrain.integrations.lightning), the step form (`for step in
fabric.strategy.steps(): for mb in step: with mb:`): a tiny GPT-2 trained through Fabric's verbs on
two ranks with uneven shares equals one process training on the concatenated big batch, through
two out-of-memory errors; and each Fabric setting that conflicts with hetrain is one UsageError
naming the fix. Fabric's own loop (`for batch in loader`) is test_fabric_plain_loop.py's.

One 2-rank run (the module's fixture) does both, so the ranks import Lightning once.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from harness import run_ranks
from hf_tiny import gpt2, token_data as tokens_of
from hf_tiny import Tokens as TokensOf
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None or
                                 importlib.util.find_spec("transformers") is None,
                                 reason='needs pip install "hetrain[lightning,hf]"')]

N, STEPS = 48, 3
SHARES, MICROS = (10, 6), (4, 6)        # rank 0: 3 micro-batches (4, 4, 2); rank 1: one of 6
# Rank 1 runs out of memory in its first forward of step 1 (micro-batch 6 -> 3, redone locally);
# rank 0 in its last backward of step 2, inside the gradient sync (4 -> 2, the step redone by both).
FAULTS = "oom:rank=1,step=1,micro=0,phase=forward; oom:rank=0,step=2,micro=-1,phase=backward"


def make_plan() -> Plan:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (1.0, 0.67), SHARES, MICROS)))
    return Plan(global_batch=sum(SHARES), devices=devices)


def token_data():
    return tokens_of(N)


class Tokens(TokensOf):
    def __init__(self):
        super().__init__(N)


def lm_loss(model, input_ids, labels):
    """The causal LM's mean loss over the counted tokens, in float64 (transformers' own loss casts
    the logits to float32, whose rounding would hide a 1e-7 difference in the weighting)."""
    logits = model(input_ids=input_ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def counted(labels):
    return (labels[:, 1:] != -100).sum()          # the tokens a causal LM's shifted mean loss averages over


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))


def refused(make) -> tuple[str, str] | str:
    from hetrain.errors import UsageError

    try:
        make()
    except UsageError as e:
        return e.what, e.fix
    return "nothing raised"


def worker(rank, world, plan, faults=FAULTS):
    from lightning.fabric import Fabric
    from torch.utils.data import DistributedSampler

    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.integrations.lightning import HetrainStrategy

    config = {"global_batch": plan.global_batch, "plan": plan, "loss_weighting": "tokens", "max_steps": STEPS,
              "emulation": Emulation(cluster="a100-80g,rtx3090:1.0", faults=faults),    # speed 1: no sleeps
              "rebalancing": Rebalancing(enabled=False), "reporting": Reporting(verbose=False)}
    bad = {   # before a job exists: at Fabric(...) and at launch, before joining
        "precision": refused(lambda: Fabric(accelerator="cpu", precision="bf16-mixed",
                                            strategy=HetrainStrategy(**config))),
        "devices": refused(lambda: Fabric(accelerator="cpu", devices=3, strategy=HetrainStrategy(**config)).launch()),
        "shuffle kwarg": refused(lambda: HetrainStrategy(**config, shuffle=False)),
    }
    strategy = HetrainStrategy(**config)
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    fabric.launch()
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Tokens()
    bad["DistributedSampler"] = refused(lambda: fabric.setup_dataloaders(
        DataLoader(data, sampler=DistributedSampler(data, num_replicas=world, rank=rank))))
    bad["batch_size"] = refused(lambda: fabric.setup_dataloaders(DataLoader(data, batch_size=4)))
    bad["steps before setup"] = refused(lambda: next(strategy.steps()))
    fabric.setup_dataloaders(DataLoader(data))     # shuffle=False: hetrain shuffles unless told; the step form
    model, opt, sched = fabric.setup(model, opt, scheduler=schedule(opt))
    out = {"indices": [], "losses": [], "micro_counts": []}
    for step in strategy.steps():
        n = 0
        for mb in step:
            with mb:
                fabric.backward(lm_loss(model, **mb.batch), tokens=counted(mb.batch["labels"]))
            n += 1
        done = opt.step()
        sched.step()
        assert done.loss == step.loss           # optimizer.step() returns hetrain's step
        out["indices"].append(list(step.indices))
        out["losses"].append(step.loss)
        out["micro_counts"].append(n)
        if step.index == 0:   # between steps, so the run goes on unchanged
            bad["clip_gradients"] = refused(lambda: fabric.clip_gradients(model, opt, max_norm=1.0))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["plan"] = strategy.engine.plan
    out["redone"] = strategy.engine.redone_steps
    out["bad"] = bad
    out["registered"] = sorted(strategy.engine.job.extra_state)
    out["fabric"] = (fabric.global_rank, fabric.world_size, str(fabric.device))
    strategy.close()
    return out


def reference(step_indices, *, per_rank_mean=None):
    """One process, no hetrain, no Fabric: the mean loss over every counted token of the step's
    concatenated samples. `per_rank_mean` (the shares): plain DDP's average of each rank's mean."""
    x, y = token_data()
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = schedule(opt)
    losses = []
    for idx in step_indices:
        idx = torch.tensor(idx)
        if per_rank_mean is None:
            loss = lm_loss(model, x[idx], y[idx])
        else:
            parts = torch.split(idx, list(per_rank_mean))
            loss = sum(lm_loss(model, x[p], y[p]) for p in parts) / len(parts)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def runs():
    return run_ranks(worker, 2, make_plan(), timeout=120)


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def test_fabric_training_on_uneven_shares_equals_the_big_batch_through_ooms(runs):
    r0, r1 = runs
    assert r0["fabric"] == (0, 2, "cpu") and r1["fabric"] == (1, 2, "cpu")
    # uneven shares in different numbers of micro-batches, as the plan and its OOM amendments say
    assert [len(i) for i in r0["indices"]] == [10] * STEPS and [len(i) for i in r1["indices"]] == [6] * STEPS
    # every `for mb in step` iteration counted, failed and redone ones too: rank 1's step 1 is its failed
    # 6 then 3 + 3; step 2 is redone by both, rank 0 at 2 x5 after its 4 + 4 + 2, rank 1 at 3 + 3 twice
    assert r0["micro_counts"] == [3, 3, 3 + 5] and r1["micro_counts"] == [1, 1 + 2, 2 + 2]
    plan = r0["plan"]
    assert plan == r1["plan"] and plan.version == 2
    assert [d.micro_batch for d in plan.devices] == [2, 3]
    assert r0["redone"] == r1["redone"] == 1                 # the OOM inside the sync: redone by both
    assert r0["registered"] == ["lr_scheduler"]              # fabric.setup's scheduler: checkpointed with the job
    steps = [r0["indices"][s] + r1["indices"][s] for s in range(STEPS)]
    assert all(len(set(s)) == sum(SHARES) for s in steps)   # every sample of a step once
    assert steps == [list(range(16 * s, 16 * s + 16)) for s in range(STEPS)]   # the DataLoader's shuffle=False
    ref_losses, ref_params = reference(steps)
    for r in runs:
        assert max_diff(r["params"], ref_params) <= 1e-9
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-9)
    # The tolerance can see a wrong weighting: plain DDP's average of the ranks' means is far off.
    _, plain_params = reference(steps, per_rank_mean=SHARES)
    assert max_diff(plain_params, ref_params) > 1e-4


def test_fabric_settings_that_conflict_with_hetrain_are_one_usage_error_naming_the_fix(runs):
    for r in runs:
        bad = r["bad"]
        assert all(isinstance(v, tuple) for v in bad.values()), bad
        what, fix = bad["precision"]
        assert "MixedPrecision ('bf16-mixed')" in what and "HetrainStrategy(precision='auto'" in fix
        what, fix = bad["devices"]
        assert "Fabric(devices=3, num_nodes=1)" in what and "2 process(es) on this node" in what
        assert "pass Fabric(devices=2, num_nodes=1)" in fix
        assert "the training DataLoader says it" in bad["shuffle kwarg"][0]
        assert "pass shuffle= to the DataLoader" in bad["shuffle kwarg"][1]
        what, fix = bad["steps before setup"]
        assert "before fabric.setup_dataloaders(train_loader) and fabric.setup(model, optimizer)" in what
        assert "in any order" in fix
        what, fix = bad["DistributedSampler"]
        assert "a DistributedSampler" in what and "remove the sampler" in fix
        what, fix = bad["batch_size"]      # 4 x 2 devices is not the global batch of 16
        assert "HetrainStrategy(global_batch=16)" in what and "batch_size=4 on 2 devices is 8" in what
        assert "DataLoader(batch_size=8)" in fix
        what, fix = bad["clip_gradients"]       # between steps: no step's gradient to clip
        assert "fabric.clip_gradients(max_norm=...) outside a step" in what
        assert "between fabric.backward(loss) and optimizer.step()" in fix


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize("make, said", [
    (lambda d: DataLoader(Stream(), batch_size=None), "batch_size=None over an IterableDataset"),   # a stream is taken
    (lambda d: DataLoader(d, sampler=torch.utils.data.SubsetRandomSampler(range(8))), "sampler=SubsetRandomSampler"),
    (lambda d: DataLoader(d, batch_sampler=torch.utils.data.BatchSampler(range(8), 2, False)), "batch_sampler="),
    (lambda d: DataLoader(d, sampler=torch.utils.data.RandomSampler(d, replacement=True)), "with replacement"),
    (lambda d: DataLoader(d, num_workers=2), "num_workers=2"),
    (lambda d: DataLoader(d, batch_size=None), "batch_size=None"),
])
def test_every_dataloader_setting_hetrain_cannot_honour_is_refused(make, said):
    from hetrain.errors import UsageError
    from hetrain.integrations.fabric.data import training_data

    with pytest.raises(UsageError) as e:
        training_data(make(Tokens()))
    assert said in e.value.what and e.value.fix


def test_the_dataloaders_shuffle_drop_last_and_collate_fn_reach_hetrain():
    from hetrain.integrations.fabric.data import training_data

    def collate(items):
        return items

    data = Tokens()
    facts = training_data(DataLoader(data, shuffle=True, drop_last=True, collate_fn=collate))
    assert (facts.dataset, facts.collate_fn, facts.shuffle, facts.drop_last) == (data, collate, True, True)
    facts = training_data(DataLoader(data))
    assert (facts.shuffle, facts.drop_last) == (False, False)
