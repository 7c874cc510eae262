"""A stream (an IterableDataset) through Fabric, the HF Trainer and Accelerate on two emulated
gloo ranks with uneven shares, float64: the same final weights as the same tool stock in one
process over the same stream.

The stream yields a fresh order each pass (set_epoch), has no __len__ and a pass that is not a
whole number of global batches. Stock tools read a stream pass by pass and end each pass with a
short batch; hetrain's default carries the tail into the next pass. So the runs that are
compared with stock use drop_last (a tail shorter than a global batch is dropped by both), and
the reference calls set_epoch(pass) before each pass, as hetrain does itself.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = pytest.mark.dist

N, B, STEPS = 40, 16, 6        # a pass: 2 global batches and a tail of 8 (dropped); 6 steps = 3 passes
SHARES, MICROS = (5, 11), (2, 11)   # rank 0: micro-batches 2, 2, 1; rank 1: one of 11
CLUSTER = "a100-80g,rtx3090:1.0"    # the plan is given: at speed 1 no emulated device sleeps


def needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"needs {module}")


def tensors():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    return x, x[:, :1] * 1.5 - x[:, 1:2] + 0.1 * torch.randn(N, 1, generator=g, dtype=torch.float64)


class Stream(IterableDataset):
    """(x, y) in an order of its own each pass; no __len__."""

    def __init__(self):
        self.x, self.y = tensors()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        ids = list(range(N))
        random.Random(50 + self.epoch).shuffle(ids)
        return ((self.x[i], self.y[i]) for i in ids)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def make_plan() -> Plan:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (0.5, 1.0), SHARES, MICROS)))
    return Plan(global_batch=B, devices=devices)


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def cases_worker(rank, world, root):
    """Every run of this file but the resumed one, one after the other in one process group (a
    tool's runs only where it is installed): {case: this rank's result}."""
    from pipeline_runs import join_group

    join_group()
    plan = f"{root}/plan.json"
    out = {}
    if installed("lightning"):
        out["fabric"] = fabric_worker(rank, world, STEPS)
        out["fabric, no max_steps"] = fabric_worker(rank, world, None)
    if installed("transformers"):
        out["trainer"] = trainer_worker(rank, world, f"{root}/out", plan, {})
        out["trainer, no max_steps"] = trainer_worker(rank, world, f"{root}/out", plan,
                                                      {"max_steps": -1, "num_train_epochs": 2})
    if installed("accelerate"):
        out["accelerate"] = accelerate_worker(rank, world, plan, {"max_steps": STEPS})
        out["accelerate, neither"] = accelerate_worker(rank, world, plan, {})
        out["accelerate, epochs"] = accelerate_worker(rank, world, plan, {"epochs": 2})
        out["accelerate, saved"] = accelerate_resume_worker(rank, world, plan, f"{root}/ckpt", False)
    return out


def resumed_worker(rank, world, root):
    """The saved Accelerate run resumed, in processes of its own as after a restart."""
    from pipeline_runs import join_group

    join_group()
    return accelerate_resume_worker(rank, world, f"{root}/plan.json", f"{root}/ckpt", True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: [rank 0's result, rank 1's]}, the resumed run under "accelerate, resumed"."""
    root = tmp_path_factory.mktemp("streams")
    (root / "plan.json").write_text(make_plan().to_json())
    results = run_ranks(cases_worker, 2, str(root), timeout=600)
    out = {case: [r[case] for r in results] for case in results[0]}
    if installed("accelerate"):
        out["accelerate, resumed"] = run_ranks(resumed_worker, 2, str(root), timeout=180)
    return {"root": root, **out}


# -- Lightning Fabric ------------------------------------------------------------------------------
def fabric_loop(fabric, model, optimizer, loader, passes, *, hetrain=True):
    """Fabric's own loop; the stream's pass set by the script, as a stock script over a stream does
    (hetrain sets it again itself). Steps counted: hetrain's optimizer.step() returns the step at
    the last micro-batch of each, stock's steps at every batch."""
    steps = 0
    for epoch in range(passes):
        loader.dataset.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(F.mse_loss(model(x), y))
            stepped = optimizer.step()
            steps += stepped is not None if hetrain else 1
    return steps, [p.detach().clone() for p in model.parameters()]


def fabric_worker(rank, world, max_steps):
    from lightning.fabric import Fabric

    from hetrain import Rebalancing, Reporting
    from hetrain.emulation import Emulation
    from hetrain.errors import UsageError
    from hetrain.integrations.lightning import HetrainStrategy

    run = {} if max_steps is None else {"max_steps": max_steps}
    strategy = HetrainStrategy(plan=make_plan(), emulation=Emulation(cluster=CLUSTER),
                               rebalancing=Rebalancing(enabled=False), reporting=Reporting(verbose=False), **run)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    try:
        loader = fabric.setup_dataloaders(DataLoader(Stream(), batch_size=B // world, drop_last=True))
    except UsageError as e:
        strategy.close()
        return str(e)
    steps, params = fabric_loop(fabric, model, optimizer, loader, passes=3)   # the first pass is the run
    strategy.close()
    return {"steps": steps, "params": params}


def fabric_stock(passes=STEPS * B // (N - N % B)):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(Stream(), batch_size=B, drop_last=True))
    return fabric_loop(fabric, model, optimizer, loader, passes, hetrain=False)


@needs("lightning")
def test_fabric_over_a_stream_on_uneven_ranks_equals_stock_fabric_in_one_process(runs):
    steps, want = fabric_stock()
    assert steps == STEPS
    for r in runs["fabric"]:
        assert r["steps"] == STEPS
        assert max_diff(r["params"], want) < 1e-12
    assert max_diff(fabric_stock(passes=2)[1], want) > 1e-3       # the tolerance sees a missing pass


@needs("lightning")
def test_fabric_over_a_stream_without_a_length_or_max_steps_is_one_line_naming_max_steps(runs):
    r0, r1 = runs["fabric, no max_steps"]
    assert r0 == r1 and "\n" not in r0
    assert "IterableDataset without a length" in r0 and "HetrainStrategy(max_steps=N)" in r0


# -- the Hugging Face Trainer ----------------------------------------------------------------------
# A pass of 48 samples is 3 whole global batches: stock's DataLoader over a stream ends a pass with
# a short batch (it ignores dataloader_drop_last for an IterableDataset), which neither hetrain's
# carry nor its drop reproduces, so the stream here has no tail and the two read the same batches.
TRAINER_N = 48


class TokenStream(IterableDataset):
    """hf_tiny's token samples, in an order of its own each pass; no __len__."""

    def __init__(self):
        from hf_tiny import token_data

        self.x, self.y = token_data(TRAINER_N)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        ids = list(range(TRAINER_N))
        random.Random(70 + self.epoch).shuffle(ids)
        return ({"input_ids": self.x[i], "labels": self.y[i]} for i in ids)


def float64_loss(outputs, labels, num_items_in_batch=None):     # Trainer(compute_loss_func=...), as test_hf_trainer
    return F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def trainer_arguments(out_dir, per_device, **kw):
    from transformers import TrainingArguments

    given = dict(output_dir=out_dir, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=1e-2,
                 optim="adamw_torch", lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
                 save_strategy="no", logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**given, **kw})


def trainer_worker(rank, world, out_dir, plan_path, args_kw):
    from hf_tiny import gpt2

    from hetrain.errors import UsageError
    from hetrain.integrations.transformers import Trainer

    try:
        trainer = Trainer(model=gpt2(), args=trainer_arguments(out_dir, B // world, **args_kw),
                          train_dataset=TokenStream(), compute_loss_func=float64_loss,
                          hetrain={"plan": plan_path, "loss_weighting": "tokens", "rebalancing": {"enabled": False},
                                   "reporting": {"verbose": False}, "emulation": {"cluster": CLUSTER}})
        result = trainer.train()
    except UsageError as e:
        return str(e)
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "global_step": result.global_step,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def trainer_stock(out_dir):
    import transformers
    from hf_tiny import gpt2

    trainer = transformers.Trainer(model=gpt2(), args=trainer_arguments(out_dir, B), train_dataset=TokenStream(),
                                   compute_loss_func=float64_loss)
    result = trainer.train()
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "global_step": result.global_step,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


@needs("transformers")
def test_the_trainer_over_a_stream_on_uneven_ranks_equals_the_stock_trainer_in_one_process(runs, tmp_path):
    stock = trainer_stock(str(tmp_path / "stock"))
    assert stock["global_step"] == STEPS
    for r in runs["trainer"]:
        assert r["global_step"] == STEPS
        assert max_diff(r["params"], stock["params"]) < 1e-12
        assert r["losses"] == pytest.approx(stock["losses"], rel=1e-6)    # the Trainer's float32 loss log


@needs("transformers")
def test_the_trainer_over_a_stream_without_a_length_or_max_steps_is_one_line_naming_max_steps(runs):
    r0, r1 = runs["trainer, no max_steps"]
    assert r0 == r1 and "\n" not in r0
    assert "IterableDataset without a length and max_steps is not set" in r0 and "max_steps=N" in r0


# -- Accelerate ------------------------------------------------------------------------------------
# As the Trainer's: a pass of 48 samples is 3 whole global batches (stock Accelerate ends a pass of
# a stream with a short batch, which neither hetrain's carry nor its drop reproduces).
ACCEL_N, ACCEL_ACCUM = 48, 2       # stock: batch 8 x 2 accumulated x 1 process; hetrain: 4 x 2 x 2 ranks


class WholeStream(IterableDataset):
    """(x, y) in an order of its own each pass, 3 whole global batches a pass; no __len__."""

    def __init__(self):
        g = torch.Generator().manual_seed(9)
        self.x = torch.randn(ACCEL_N, 4, generator=g, dtype=torch.float64)
        self.y = self.x[:, :1] * 1.5 - self.x[:, 1:2] + 0.1 * torch.randn(ACCEL_N, 1, generator=g, dtype=torch.float64)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        ids = list(range(ACCEL_N))
        random.Random(90 + self.epoch).shuffle(ids)
        return ((self.x[i], self.y[i]) for i in ids)


def accelerate_script(accelerator, batch_size, passes):
    """A stock Accelerate loop over a stream, the pass set by the script (hetrain sets it again)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(WholeStream(), batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    for epoch in range(passes):
        loader.dataset.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                steps += accelerator.sync_gradients
                optimizer.step()
                optimizer.zero_grad()
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    accelerator.end_training()
    return {"steps": steps, "params": params}


def accelerate_worker(rank, world, plan_path, run_length):
    from hetrain.errors import UsageError
    from hetrain.integrations.accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=ACCEL_ACCUM, hetrain={
        "plan": plan_path, "rebalancing": {"enabled": False}, "reporting": {"verbose": False},
        "emulation": {"cluster": CLUSTER}, **run_length})
    try:
        return accelerate_script(accelerator, B // ACCEL_ACCUM // world, passes=2)   # the first pass is the run
    except UsageError as e:
        return str(e)


def accelerate_stock(passes):
    import accelerate

    return accelerate_script(accelerate.Accelerator(gradient_accumulation_steps=ACCEL_ACCUM, cpu=True),
                             B // ACCEL_ACCUM, passes)


@needs("accelerate")
def test_accelerate_over_a_stream_on_uneven_ranks_equals_plain_accelerate_in_one_process(runs):
    want = accelerate_stock(passes=2)
    assert want["steps"] == STEPS
    for r in runs["accelerate"]:
        assert r["steps"] == STEPS
        assert max_diff(r["params"], want["params"]) < 1e-12
    assert max_diff(accelerate_stock(passes=1)["params"], want["params"]) > 1e-3   # the tolerance sees a missing pass


@needs("accelerate")
@pytest.mark.parametrize("run_length", [{}, {"epochs": 2}], ids=["neither", "epochs"])
def test_accelerate_over_a_stream_without_a_length_or_max_steps_is_one_line_naming_max_steps(runs, run_length):
    r0, r1 = runs["accelerate, epochs" if run_length else "accelerate, neither"]
    assert r0 == r1 and "\n" not in r0
    assert "IterableDataset without a length" in r0 and "hetrain={'max_steps': N}" in r0


def accelerate_resume_worker(rank, world, plan_path, out_dir, resume):
    """The whole run saves after step 4 (mid-pass: a pass is 3 steps); the resumed run loads it
    and trains the last 2 steps, from the stream's position in the checkpoint."""
    from hetrain.integrations.accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=ACCEL_ACCUM, hetrain={
        "plan": plan_path, "rebalancing": {"enabled": False}, "reporting": {"verbose": False},
        "emulation": {"cluster": CLUSTER}, "max_steps": STEPS})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(WholeStream(), batch_size=B // ACCEL_ACCUM // world)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    if resume:
        accelerator.load_state(out_dir)
    for x, y in loader:
        accelerator.backward(F.mse_loss(model(x), y))
        synced = accelerator.sync_gradients
        optimizer.step()
        steps += synced
        if synced and not resume and steps == 4:
            accelerator.save_state(out_dir)
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    accelerator.end_training()
    return {"steps": steps, "params": params}


@needs("accelerate")
def test_accelerate_over_a_stream_resumes_mid_stream_exactly(runs):
    whole, resumed = runs["accelerate, saved"], runs["accelerate, resumed"]
    for w, r in zip(whole, resumed):
        assert (w["steps"], r["steps"]) == (STEPS, 2)
        assert max_diff(r["params"], w["params"]) == 0.0
    assert max_diff(whole[0]["params"], accelerate_stock(passes=2)["params"]) < 1e-12
