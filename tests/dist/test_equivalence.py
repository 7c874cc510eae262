"""Uneven per-rank batches give the gradient of one big batch on one device (the core promise).

Reference: a single process computing the mean loss over the concatenation of every rank's
samples — independent of hetrain's sampler and weighting.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain.planning.plan import DevicePlan, Plan
from hetrain import Reporting

pytestmark = pytest.mark.dist

N, D, V, T = 256, 8, 11, 6


def make_plan(shares, micros) -> Plan:
    devices = tuple(DevicePlan(rank=r, device=f"cpu{r}", speed=1.0, share=s, micro_batch=m)
                    for r, (s, m) in enumerate(zip(shares, micros)))
    return Plan(global_batch=sum(shares), devices=devices)


def regression_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)


def regression_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def token_data():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, V, (N, T), generator=g)
    y = torch.randint(0, V, (N, T), generator=g)
    y[torch.rand(N, T, generator=g) < 0.4] = -100          # tokens that do not count, unevenly
    return x, y


def token_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, 12), torch.nn.Tanh(), torch.nn.Linear(12, V))


def loss_of(kind, model, x, y):
    out = model(x)
    if kind == "samples":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), ignore_index=-100)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients it was asked to apply first: after hetrain's weighting,
    synchronisation and (for tokens) count correction — the gradient the update really used."""

    first_grads = None

    def step(self, closure=None):
        if self.first_grads is None:
            self.first_grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def worker(rank, world, kind, plan, steps):
    import hetrain

    x, y = regression_data() if kind == "samples" else token_data()
    model = regression_model() if kind == "samples" else token_model()
    ht = hetrain.init(global_batch=plan.global_batch, plan=plan, loss_weighting=kind,
                      max_steps=steps, reporting=Reporting(verbose=False))
    opt = RecordingSGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y))
    record = {"indices": [], "grads": None, "losses": [], "micro_counts": []}
    for step in batches:
        n = 0
        for mb in step:
            with mb:
                bx, by = mb.batch
                loss = loss_of(kind, model, bx, by)
                ht.backward(loss, tokens=(by != -100).sum() if kind == "tokens" else None)
                n += 1
        record["micro_counts"].append(n)
        record["indices"].append(list(step.indices))
        ht.step()
        record["losses"].append(step.loss)
    record["params"] = [p.detach().clone() for p in model.parameters()]
    record["grads"] = opt.first_grads
    ht.close()
    return record


def reference(kind, step_indices, steps):
    x, y = regression_data() if kind == "samples" else token_data()
    model = regression_model() if kind == "samples" else token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads, losses = None, []
    for s in range(steps):
        idx = torch.tensor(step_indices[s])
        loss = loss_of(kind, model, x[idx], y[idx])
        loss.backward()
        if s == 0:
            grads = [p.grad.detach().clone() for p in model.parameters()]
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return grads, losses, [p.detach() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


CASES = {
    # two ranks, 24/40 split, 3 micro-batches against 1
    "2 ranks 24/40": ((24, 40), (8, 40)),
    # three ranks, 7/13/12 split, 3, 1 and 3 micro-batches of uneven sizes
    "3 ranks 7/13/12": ((7, 13, 12), (3, 13, 5)),
}


STEPS = {"samples": 3, "tokens": 2}


def both_worker(rank, world, plan):
    """The sample-weighted job, then the token-weighted one, in one process group."""
    from pipeline_runs import join_group

    join_group()
    return {kind: worker(rank, world, kind, plan, steps) for kind, steps in STEPS.items()}


@pytest.fixture(scope="module")
def runs():
    """{(case, kind): [each rank's record]}."""
    out = {}
    for case, (shares, micros) in CASES.items():
        results = run_ranks(both_worker, len(shares), make_plan(shares, micros))
        out.update({(case, kind): [r[kind] for r in results] for kind in STEPS})
    return out


@pytest.mark.parametrize("case", CASES)
def test_sample_weighted_gradients_and_updates_equal_single_process(runs, case):
    shares, micros = CASES[case]
    plan = make_plan(shares, micros)
    steps = STEPS["samples"]
    records = runs[case, "samples"]
    assert [r["micro_counts"][0] for r in records] == [plan.devices[i].n_micro for i in range(len(shares))]
    step_indices = [sum((r["indices"][s] for r in records), []) for s in range(steps)]
    for idx in step_indices:
        assert len(idx) == plan.global_batch and len(set(idx)) == plan.global_batch
    ref_grads, ref_losses, ref_params = reference("samples", step_indices, steps)
    for r in records:
        assert max_diff(r["grads"], ref_grads) <= 1e-5
        assert max_diff(r["params"], ref_params) <= 1e-5
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)


def test_unweighted_average_would_differ():
    """Guard on the test itself: the 24/40 case is one where plain DDP averaging is wrong."""
    shares = (24, 40)
    x, y = regression_data()
    idx = list(range(64))
    model = regression_model()
    loss_of("samples", model, x[idx], y[idx]).backward()
    full = [p.grad.clone() for p in model.parameters()]
    per_rank = []
    start = 0
    for s in shares:
        model.zero_grad()
        loss_of("samples", model, x[idx[start:start + s]], y[idx[start:start + s]]).backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
        start += s
    plain = [(a + b) / 2 for a, b in zip(*per_rank)]
    assert max_diff(plain, full) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_token_weighted_gradients_equal_single_process(runs, case):
    steps = STEPS["tokens"]
    records = runs[case, "tokens"]
    step_indices = [sum((r["indices"][s] for r in records), []) for s in range(steps)]
    ref_grads, ref_losses, ref_params = reference("tokens", step_indices, steps)
    for r in records:
        assert max_diff(r["grads"], ref_grads) <= 1e-5
        assert max_diff(r["params"], ref_params) <= 1e-5
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
