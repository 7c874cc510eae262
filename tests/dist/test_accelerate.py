"""Accelerate scripts on hetrain (hetrain.integrations.accelerate): one script, its own loop with
prepare / accumulate / backward / clip_grad_norm_ / optimizer.step / lr_scheduler.step /
gather_for_metrics / save_state / load_state, run by plain Accelerate in one process and by
hetrain's Accelerator on two emulated ranks with uneven shares, gives the same weights (float64:
the same sums in another order), the same evaluation outputs in the dataset's order, and resumes
from save_state exactly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = [pytest.mark.dist, pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                                   reason='needs pip install "hetrain[hf]"')]

N, EVAL_N, EPOCHS = 64, 21, 2        # 4 steps of 16 an epoch; 21 evaluation samples: a short last batch
ACCUM, STOCK_BATCH, RANK_BATCH = 2, 8, 4     # stock: 8 x 2 x 1 process = 16; hetrain: 4 x 2 x 2 ranks = 16
SHARES, MICROS = (10, 6), (4, 6)     # rank 0 runs 4, 4, 2 a step; rank 1 one of 6
CLUSTER = "a100-80g,rtx3090:1.0"     # the plans are given: at speed 1 no emulated device sleeps


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        self.y = (self.x[:, :1] * 2 - self.x[:, 1:2]).sin() + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def script(accelerator_cls, batch_size: int, out_dir: str, *, save_after=None, resume=False, **accel_kwargs):
    """An Accelerate training script, as written for stock Accelerate."""
    accelerator = accelerator_cls(gradient_accumulation_steps=ACCUM, **accel_kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    # stock steps a scheduler once per process per optimizer step (AcceleratedScheduler)
    total = EPOCHS * N // (STOCK_BATCH * ACCUM) * accelerator.num_processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)
    train = torch.utils.data.DataLoader(Points(N, 0), batch_size=batch_size, shuffle=False)
    evaluate = torch.utils.data.DataLoader(Points(EVAL_N, 1), batch_size=5)
    model, optimizer, train, evaluate, scheduler = accelerator.prepare(model, optimizer, train, evaluate, scheduler)
    start = 0
    if resume:
        accelerator.load_state(out_dir)
        start = 1
    syncs = 0
    for epoch in range(start, EPOCHS):
        for x, y in train:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    syncs += 1
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if save_after == epoch:
            accelerator.wait_for_everyone()
            accelerator.save_state(out_dir)
    model.eval()
    outputs = []
    with torch.no_grad():
        for x, _ in evaluate:
            outputs.append(accelerator.gather_for_metrics(model(x)))
    accelerator.print(f"trained {syncs} steps")
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    main = accelerator.is_main_process
    accelerator.end_training()
    return {"params": params, "outputs": torch.cat(outputs), "syncs": syncs, "main": main,
            "lr": scheduler.get_last_lr()[0]}


def write_plan(path, micros=MICROS) -> str:
    devices = tuple(DevicePlan(rank=r, device=name, speed=speed, share=s, micro_batch=m)
                    for r, (name, speed, s, m) in enumerate(zip(("a100-80g", "rtx3090"), (1.0, 0.67), SHARES, micros)))
    path.write_text(Plan(global_batch=sum(SHARES), devices=devices).to_json())
    return str(path)


def worker(rank, world, out_dir, plan, save_after=None, resume=False):
    from hetrain.integrations.accelerate import Accelerator

    return script(Accelerator, RANK_BATCH, out_dir, save_after=save_after, resume=resume,
                  hetrain={"plan": plan, "rebalancing": {"enabled": False}, "reporting": {"verbose": False},
                           "emulation": {"cluster": CLUSTER}})


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def cases_worker(rank, world, out_dir, plans):
    """The runs that return, one after the other in one process group: the script saving after
    epoch 0, the script's own accumulation (one micro-batch a rank, then rank 0 in two), a loop
    body failing on rank 1 and caught."""
    from pipeline_runs import join_group

    join_group()
    return {"saved": worker(rank, world, out_dir, plans["given"], 0),
            "manual": manual_worker(rank, world, plans["one micro-batch"]),
            "manual 5 + 5": manual_worker(rank, world, plans["5 + 5"]),
            "caught": failing_worker(rank, world, plans["given"], True)}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    d = tmp_path_factory.mktemp("accelerate")
    plans = {"given": write_plan(d / "plan.json"), "one micro-batch": write_plan(d / "one.json", micros=SHARES),
             "5 + 5": write_plan(d / "five.json", micros=(5, 6))}
    results = run_ranks(cases_worker, 2, str(d / "ckpt"), plans, timeout=400)
    return d, plans["given"], {case: [r[case] for r in results] for case in results[0]}


@pytest.fixture(scope="module")
def runs(group):
    import accelerate

    d, plan, cases = group
    stock = script(accelerate.Accelerator, STOCK_BATCH, str(d / "stock"))
    return d, plan, stock, cases["saved"]      # saved after epoch 0


def test_an_accelerate_loop_on_uneven_shares_equals_plain_accelerate_in_one_process(runs):
    _, _, stock, ranks = runs
    assert stock["syncs"] == EPOCHS * N // (STOCK_BATCH * ACCUM) == 8
    for r in ranks:
        assert r["syncs"] == 8                  # sync_gradients: once a step on each rank, whatever its micro-batches
        assert max_diff(r["params"], stock["params"]) <= 1e-12
        assert r["lr"] == pytest.approx(stock["lr"])             # the scheduler stepped once a global step
    assert [r["main"] for r in ranks] == [True, False]
    # The tolerance sees a wrong weighting: one step on rank 0's 10 samples alone is a different step.
    x, y = Points(N, 0)[:16]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    whole = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    part = torch.autograd.grad(F.mse_loss(model(x[:10]), y[:10]), list(model.parameters()))
    assert max_diff(whole, part) > 1e-3


def test_gather_for_metrics_returns_each_sample_once_in_the_datasets_order(runs):
    _, _, stock, ranks = runs
    for r in ranks:
        assert r["outputs"].shape == (EVAL_N, 1)       # the short last batch's repeated sample dropped
        assert torch.allclose(r["outputs"], stock["outputs"], rtol=0, atol=1e-12)


def test_save_state_then_load_state_resumes_exactly(runs):
    d, plan, _, ranks = runs
    resumed = run_ranks(worker, 2, str(d / "ckpt"), plan, None, True, timeout=180)
    for r, whole in zip(resumed, ranks):
        assert r["syncs"] == 4                          # the second epoch only
        assert max_diff(r["params"], whole["params"]) == 0.0
        assert r["lr"] == whole["lr"]                   # the scheduler's state came back with the job's


def manual_script(accelerator_cls, batch_size: int, **accel_kwargs):
    """Accelerate's nlp_example.py loop with a batch over its maximum: the Accelerator accumulates
    nothing, the script divides the loss by 2 and steps the optimizer every other batch."""
    accelerator = accelerator_cls(**accel_kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    train = torch.utils.data.DataLoader(Points(N, 0), batch_size=batch_size, shuffle=False, drop_last=True)
    total = len(train) * EPOCHS // 2
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (total * 2))
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)
    stepped = 0
    for _ in range(EPOCHS):
        for step, (x, y) in enumerate(train):
            accelerator.backward(F.mse_loss(model(x), y) / 2)
            if step % 2 == 0:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                stepped += 1
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    accelerator.end_training()
    return {"params": params, "stepped": stepped, "lr": scheduler.get_last_lr()[0]}


def manual_worker(rank, world, plan):
    from hetrain.errors import UsageError
    from hetrain.integrations.accelerate import Accelerator

    try:
        return manual_script(Accelerator, STOCK_BATCH * ACCUM // world, hetrain={
            "plan": plan, "rebalancing": {"enabled": False}, "reporting": {"verbose": False},
            "emulation": {"cluster": CLUSTER}})
    except UsageError as e:
        return str(e)


def test_a_scripts_own_accumulation_on_uneven_shares_equals_one_process(group):
    """nlp_example.py's manual accumulation: 16 samples a batch (10 and 6 on the two ranks), the
    optimizer stepped after batches 0, 2 of each epoch of 4: what one stock process does."""
    import accelerate

    stock = manual_script(accelerate.Accelerator, STOCK_BATCH * ACCUM, cpu=True)
    assert stock["stepped"] == 4
    for r in group[2]["manual"]:
        assert isinstance(r, dict), r
        assert r["stepped"] == 4
        assert max_diff(r["params"], stock["params"]) <= 1e-12
        assert r["lr"] == pytest.approx(stock["lr"])    # twice the scheduler steps over twice the batches
    # The tolerance sees another batching of the same loop (8 samples a batch, one process).
    every = manual_script(accelerate.Accelerator, STOCK_BATCH * ACCUM // 2, cpu=True)
    assert max_diff(every["params"], stock["params"]) > 1e-3


def test_a_scripts_own_accumulation_over_several_micro_batches_a_rank_is_one_line_naming_the_fix(group):
    # rank 0 runs its 10 samples as 5 + 5: its batches 1, 3, ... end the steps, rank 1's 0, 1, 2, ...
    said = group[2]["manual 5 + 5"]
    assert said[0] == said[1]
    assert "called optimizer.step() after their last batch" in said[0] and "accumulate(model)" in said[0]
    assert "\n" not in said[0]


def failing_worker(rank, world, plan, caught):
    """The script's loop body raises on rank 1 in the middle of step 1; rank 0 goes on into the
    step's gradient sync. `caught`: the script catches its own error (else it leaves the function)."""
    from hetrain.errors import HetrainError
    from hetrain.integrations.accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, hetrain={
        "plan": plan, "rebalancing": {"enabled": False}, "reporting": {"verbose": False},
        "emulation": {"cluster": CLUSTER}})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    train = torch.utils.data.DataLoader(Points(N, 0), batch_size=RANK_BATCH)
    model, optimizer, train = accelerator.prepare(model, optimizer, train)

    def loop():
        for x, y in train:
            accelerator.backward(F.mse_loss(model(x), y))
            if rank == 1 and accelerator.joined().steps_done == 1:
                raise ValueError("the loop body's own error")
            optimizer.step()

    if not caught:
        loop()
        return "nothing raised"
    try:
        loop()
    except (HetrainError, ValueError) as e:
        return type(e).__name__, getattr(e, "what", str(e)), accelerator.joined().steps_done
    return "nothing raised"


@pytest.mark.parametrize("caught", [True, False], ids=["caught", "out of the function"])
def test_a_loop_body_failing_on_one_rank_stops_every_rank_with_one_error(group, caught):
    _, plan, cases = group
    if caught:
        (kind0, what0, done0), (kind1, what1, done1) = cases["caught"]
        assert (kind1, what1) == ("ValueError", "the loop body's own error")
        assert kind0 == "LoopStopped" and done0 == done1 == 1
        assert "at step 1, rank 1 (rtx3090) left the loop in the middle of the step" in what0
        return
    with pytest.raises(AssertionError) as failed:          # both ranks raised: neither hung
        run_ranks(failing_worker, 2, plan, False, timeout=180)
    report = str(failed.value)
    assert "hung" not in report
    rank0, rank1 = report.split("rank 1: raised")
    assert "rank 0: raised" in rank0 and "LoopStopped" in rank0
    assert "at step 1, rank 1 (rtx3090) left the loop in the middle of the step" in rank0
    assert "ValueError: the loop body's own error" in rank1             # the rank's own error, reported


# A real script under torchrun (not the harness, whose ranks catch the error and leave at once):
# rank 1 raises out of the whole script while it keeps the loader's iterator in a variable. The
# traceback Python keeps for the exit holds that iterator open, so only the loop's exit handler
# settles the step; without it rank 0 lost rank 1 in the gradient sync when its process ended.
HELD_SCRIPT = '''
import os, sys
import torch
import torch.nn.functional as F
from hetrain.integrations.accelerate import Accelerator

rank = int(os.environ["RANK"])
accelerator = Accelerator(gradient_accumulation_steps=2, hetrain={"plan": sys.argv[1], "rebalancing": {"enabled": False},
                          "reporting": {"verbose": False}, "emulation": {"cluster": "a100-80g,rtx3090:1.0"}})
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
x = torch.randn(64, 8, dtype=torch.float64)
data = torch.utils.data.TensorDataset(x, x[:, :1].sin())
model, optimizer, train = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
batches = iter(train)


def main():
    for inputs, target in batches:
        accelerator.backward(F.mse_loss(model(inputs), target))
        if rank == 1 and accelerator.joined().steps_done == 1:
            raise ValueError("the loop body's own error")
        optimizer.step()


main()
'''


def test_a_script_raising_out_of_itself_with_its_iterator_held_stops_every_rank(tmp_path):
    import os
    import subprocess
    import sys

    from harness import SRC, free_port

    script = tmp_path / "train.py"
    script.write_text(HELD_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), write_plan(tmp_path / "plan.json")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ValueError: the loop body's own error" in out                # rank 1's own error, reported
    assert "at step 1, rank 1 (rtx3090) left the loop in the middle of the step" in out, out[-3000:]
