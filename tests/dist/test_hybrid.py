"""DP × PP on a 2×2 mesh (4 ranks) gives the gradient of one big batch on one device, with
replicas computing uneven shares of the global batch (by throughput, or given).

Reference: the whole demo GPT, built from the same seed, on the whole global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

pytestmark = pytest.mark.dist

# replica 0 = two fast devices, replica 1 = two half-speed ones: by throughput, shares 2 : 1
CLUSTER = "a100-80g:1.0,a100-80g:1.0,rtx3090:0.5,rtx3090:0.5"


def case():
    from hetrain.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=4, n_heads=2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (12, 8), generator=g), torch.randint(0, 32, (12, 8), generator=g)
    return model, x, y


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def hybrid_worker(rank, world, runs):
    import hetrain
    from hetrain.parallel import hybrid

    model, x, y = case()
    ref_loss = loss_fn(model(x), y)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    ht = hetrain.init(global_batch=12, emulate=CLUSTER, verbose=False)
    out = []
    for schedule, split, shares in runs:
        model = case()[0]
        pp = hybrid.prepare(ht, model, loss_fn=loss_fn, stages=2, micro_batches=2, schedule=schedule,
                            split=split, shares=shares, example=x[:2])
        loss = pp.step(x, y)
        out.append({"sizes": pp.split.sizes, "shares": pp.shares, "replica": pp.replica, "stage": pp.stage_index,
                    "micro": pp.micro_batch_size, "loss_error": abs(loss - ref_loss.item()),
                    "grad_error": max((p.grad - ref[n]).abs().max().item() for n, p in pp.named_parameters()),
                    "names": [n for n, _ in pp.named_parameters()]})
        pp.close()
    ht.close()
    return out


def test_dp_x_pp_matches_one_big_batch_with_uneven_replica_shares():
    runs = [("1f1b", None, None), ("gpipe", [3, 1], (3, 9))]
    results = run_ranks(hybrid_worker, 4, runs, timeout=240)
    planned, given = zip(*results)
    assert [(r["replica"], r["stage"]) for r in planned] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in planned + given:
        assert r["grad_error"] < 1e-6, r
        assert r["loss_error"] < 1e-6, r
    # planned: one split for both replicas, the fast replica gets twice the slow one's share
    assert len({r["sizes"] for r in planned}) == 1
    assert planned[0]["shares"] == (8, 4)
    assert [r["micro"] for r in planned] == [4, 4, 2, 2]
    # given: 3 rows (2 + 1 padded to 2) and 9 rows (5 + 4 padded to 5)
    assert given[0]["shares"] == (3, 9) and [r["micro"] for r in given] == [2, 2, 5, 5]
    assert given[0]["sizes"] == (3, 1)
    # the tied embedding/head weight lives on both ends of each pipeline
    assert all("tok.weight" in r["names"] for r in given)
