"""Pipelines give the gradient of one big batch on one device (real gloo process groups).

Reference: the same model, built from the same seed in each rank's process, run whole on the
global batch with the plain mean loss — independent of stages, schedules, padding and weighting.
Cases: the demo GPT (tied embedding/head across stages) and a plain nn.Sequential stack; 2 and 3
stages; uneven block counts; GPipe and 1F1B; micro-batches of unequal size (10 rows in 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

pytestmark = pytest.mark.dist


def gpt_case():
    from hetrain.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=4, n_heads=2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (10, 8), generator=g), torch.randint(0, 32, (10, 8), generator=g))
               for _ in range(2)]
    return model, batches, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())


class Residual(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def stack_case():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Residual(6) for _ in range(6)))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(10, 6, generator=g), torch.randn(10, 6, generator=g)) for _ in range(2)]
    return model, batches, F.mse_loss


def reference(make, steps_lr=0.1):
    """Grads and losses of the whole model on each global batch, with SGD between steps."""
    model, batches, loss_fn = make()
    opt = torch.optim.SGD(model.parameters(), lr=steps_lr)
    out = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()   # the tied weight once
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, norm))
        opt.step()
        opt.zero_grad()
    return out


def pipeline_worker(rank, world, case, runs):
    import hetrain
    from hetrain.parallel import pipeline

    make = {"gpt": gpt_case, "stack": stack_case}[case]
    expected = reference(make)
    ht = hetrain.init(global_batch=10, verbose=False)
    results = []
    for schedule, split in runs:
        model, batches, loss_fn = make()
        pp = pipeline.prepare(ht, model, loss_fn=loss_fn, micro_batches=4, schedule=schedule, split=split)
        opt = torch.optim.SGD(pp.parameters(), lr=0.1)
        errors, loss_errors, names = [], [], []
        for (x, y), (ref_loss, ref_grads, ref_norm) in zip(batches, expected):
            loss = pp.step(x, y)
            names = sorted(n for n, _ in pp.named_parameters())
            errors.append(max((p.grad - ref_grads[n]).abs().max().item() for n, p in pp.named_parameters()))
            loss_errors.append(abs(loss - ref_loss) + abs(pp.clip_grad_norm_(1e9) - ref_norm))
            opt.step()
            opt.zero_grad()
        results.append({"schedule": schedule, "sizes": pp.split.sizes, "grad_error": max(errors),
                        "loss_error": max(loss_errors), "names": names, "peak_in_flight": pp.peak_in_flight,
                        "planned_in_flight": pp.split.stages[rank].in_flight,
                        "bubble": pp.bubble_fraction})
        pp.close()
    if case == "gpt":   # two steps without zeroing: gradients accumulate as in one process
        model, batches, loss_fn = make()
        for x, y in batches:
            loss_fn(model(x), y).backward()
        summed = {n: p.grad.clone() for n, p in model.named_parameters()}
        model, batches, loss_fn = make()
        pp = pipeline.prepare(ht, model, loss_fn=loss_fn, micro_batches=4, schedule="1f1b", split=[2, 2])
        for x, y in batches:
            pp.step(x, y)
        results.append(max((p.grad - summed[n]).abs().max().item() for n, p in pp.named_parameters()))
        pp.close()
    if world == 3:   # more stages than blocks: every rank says so (none waits for a peer)
        from hetrain.errors import UsageError

        try:
            pipeline.prepare(ht, torch.nn.Sequential(Residual(4), Residual(4)), loss_fn=F.mse_loss,
                             micro_batches=4, split="uniform")
            results.append("no error")
        except UsageError as e:
            results.append(str(e))
    ht.close()
    return results


def check(results, world, runs):
    all_names = set()
    for rank_results in results:
        for (schedule, split), r in zip(runs, rank_results):
            assert r["sizes"] == tuple(split)
            assert r["grad_error"] < 1e-6, (schedule, split, r)
            assert r["loss_error"] < 1e-6, (schedule, split, r)
            # activations in flight are what the planner's memory model assumes for the schedule
            assert r["peak_in_flight"] == r["planned_in_flight"], r
            assert r["bubble"] == pytest.approx((world - 1) / (4 + world - 1))
            all_names.update(r["names"])
    return all_names


def test_gpt_two_stages_gpipe_and_1f1b_uneven_blocks_and_micro_batches():
    runs = [("gpipe", [3, 1]), ("1f1b", [1, 3])]
    results = run_ranks(pipeline_worker, 2, "gpt", runs)
    assert all(r[-1] < 1e-6 for r in results)       # accumulated over two steps
    names = check(results, 2, runs)
    # every parameter of the model lives on some stage; the tied weight on both ends
    model = gpt_case()[0]
    assert names == {n for n, _ in model.named_parameters()}
    assert "tok.weight" in results[0][0]["names"] and "tok.weight" in results[1][0]["names"]
    # GPipe holds all 4 micro-batches; 1F1B holds p − stage (2 on stage 0, 1 on stage 1)
    assert [r[0]["peak_in_flight"] for r in results] == [4, 4]
    assert [r[1]["peak_in_flight"] for r in results] == [2, 1]


def test_sequential_three_stages_gpipe_and_1f1b_and_too_many_stages():
    runs = [("gpipe", [1, 3, 2]), ("1f1b", [2, 1, 3])]
    results = run_ranks(pipeline_worker, 3, "stack", runs)
    names = check(results, 3, runs)
    assert len(names) == 12                     # 6 blocks × (weight, bias), each on one stage
    assert [r[1]["peak_in_flight"] for r in results] == [3, 2, 1]
    for r in results:
        assert "cannot cut 2 blocks into 3 pipeline stages" in r[-1] and "DP×PP" in r[-1]


def speed_worker(rank, world):
    import hetrain
    from hetrain.parallel import pipeline

    model, batches, loss_fn = stack_case()
    expected = reference(stack_case)
    ht = hetrain.init(global_batch=10, emulate="a100-80g:1.0,rtx3090:0.5", verbose=False)
    x, y = batches[0]
    pp = pipeline.prepare(ht, model, loss_fn=loss_fn, micro_batches=2, schedule="gpipe", example=x[:5])
    loss = pp.step(x, y)
    err = max((p.grad - expected[0][1][n]).abs().max().item() for n, p in pp.named_parameters())
    out = {"sizes": pp.split.sizes, "error": err, "loss_error": abs(loss - expected[0][0]),
           "slept": ht.emulated.throttle.slept_seconds, "compute": pp.compute_seconds,
           "activation_bytes": pp.peak_activation_bytes}
    # a device too small for the activations in flight: every rank stops together, naming it
    if rank == 1:
        ht.emulated.meter.cap = ht.emulated.meter.fixed + 1
    try:
        pp.step(x, y)
        out["oom"] = "no error"
    except torch.OutOfMemoryError as e:
        out["oom"] = str(e)
    pp.close()
    ht.close()
    return out


def test_split_follows_emulated_speeds_and_throttles():
    results = run_ranks(speed_worker, 2)
    a100, rtx = results
    assert a100["sizes"] == rtx["sizes"]                   # one agreed split
    assert a100["sizes"][0] > a100["sizes"][1]             # the faster device holds more blocks
    for r in results:
        assert r["error"] < 1e-6 and r["loss_error"] < 1e-6
        assert r["activation_bytes"] > 0                   # counted on emulated devices
    for r in results:
        assert "rank 1 (stage 1)" in r["oom"] and "out of memory (emulated)" in r["oom"]
    assert a100["slept"] == 0.0
    # the 0.5-speed device sleeps c·(1/0.5 − 1) = c after each piece of compute c
    assert rtx["slept"] == pytest.approx(rtx["compute"], rel=1e-6)
