"""A tokenizer's BatchEncoding (what tokenizer.pad and DataCollatorWithPadding return) and a
dataclass as the batch: hetrain plans the job by calling the model on it (model(**batch), as the
Trainer does) and a 2-rank run over uneven shares equals one process on the same samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import run_ranks
from hetrain import Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

N = 96
CLUSTER = "a100-80g,rtx3090"     # unequal emulated devices: the measured plan splits unevenly


def encodings(items):
    from transformers import BatchEncoding

    return BatchEncoding({"input_ids": torch.stack([i["input_ids"] for i in items]),
                          "labels": torch.stack([i["labels"] for i in items])})


def encoding_worker(rank, world, steps):
    import hetrain
    from hf_tiny import Tokens, gpt2

    ht = hetrain.init(global_batch=24, max_steps=steps, loss_weighting="tokens",
                      emulation=Emulation(cluster=CLUSTER), reporting=Reporting(verbose=False))
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, batches = ht.prepare(model, opt, Tokens(N), collate_fn=encodings)
    seen, kinds = [], set()
    for step in batches:
        for mb in step:
            with mb:
                kinds.add(type(mb.batch).__name__)
                loss = model(**mb.batch).loss
                ht.backward(loss, tokens=(mb.batch["labels"][:, 1:] != -100).sum())
        seen.append(list(step.indices))
        ht.step()
    shares = [d.share for d in ht.plan.devices]
    params = [p.detach().clone() for p in model.parameters()]
    ht.close()
    return {"indices": seen, "params": params, "kinds": kinds, "shares": shares}


def test_batch_encoding_batches_plan_and_train_as_one_process():
    from hf_tiny import Tokens, gpt2

    steps = 2
    records = run_ranks(encoding_worker, 2, steps, timeout=300)
    assert records[0]["kinds"] == {"BatchEncoding"}
    assert records[0]["shares"][0] != records[0]["shares"][1]
    data, model = Tokens(N), gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        idx = sum((r["indices"][s] for r in records), [])
        assert len(set(idx)) == 24
        model(input_ids=data.x[idx], labels=data.y[idx]).loss.backward()
        opt.step()
        opt.zero_grad()
    for r in records:
        assert max((a - b).abs().max().item() for a, b in zip(r["params"], model.parameters())) < 1e-8


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Regression(torch.nn.Module):
    """A model written for the dataclass batch (its forward takes the batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def forward(self, batch: Batch):
        return self.net(batch.x)


def regression_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randn(N, 1, generator=g, dtype=torch.float64)


def uneven_plan():
    from hetrain.planning.plan import DevicePlan, Plan

    return Plan(global_batch=24, devices=(DevicePlan(rank=0, device="cpu0", speed=1.0, share=10, micro_batch=4),
                                          DevicePlan(rank=1, device="cpu1", speed=1.0, share=14, micro_batch=14)))


def dataclass_worker(rank, world, steps):
    import hetrain

    x, y = regression_data()
    ht = hetrain.init(global_batch=24, max_steps=steps, plan=uneven_plan(), reporting=Reporting(verbose=False))
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, batches = ht.prepare(model, opt, torch.utils.data.TensorDataset(x, y),
                                     collate_fn=lambda items: Batch(torch.stack([a for a, _ in items]),
                                                                    torch.stack([b for _, b in items])))
    seen = []
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(torch.nn.functional.mse_loss(model(mb.batch), mb.batch.y))
        seen.append(list(step.indices))
        ht.step()
    shares = [d.share for d in ht.plan.devices]
    params = [p.detach().clone() for p in model.parameters()]
    ht.close()
    return {"indices": seen, "params": params, "shares": shares}


def test_dataclass_batches_plan_and_train_as_one_process():
    steps = 2
    records = run_ranks(dataclass_worker, 2, steps, timeout=300)
    assert records[0]["shares"][0] != records[0]["shares"][1]
    (x, y), model = regression_data(), Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        idx = sum((r["indices"][s] for r in records), [])
        torch.nn.functional.mse_loss(model(Batch(x[idx], y[idx])), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    for r in records:
        assert max((a - b).abs().max().item() for a, b in zip(r["params"], model.parameters())) < 1e-8
