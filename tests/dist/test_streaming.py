"""ht.prepare over a stream (an IterableDataset, runtime/loop/stream.py) on real gloo ranks with
uneven shares: the weights of one process over the same stream, every sample once a pass, a
resume mid-stream equal to the run it interrupted, a `datasets` stream from a generator.

Reference: one process reading the stream pass after pass (set_epoch(e), then iter) and
stepping on every B samples, float64: independent of hetrain's sampler and weighting."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Checkpoints, Rebalancing, Reporting
from hetrain.emulation import Emulation
from hetrain.planning.plan import DevicePlan, Plan

pytestmark = pytest.mark.dist

N, D, B, STEPS = 37, 4, 16, 6      # 6 steps of 16: passes 0 and 1 whole, 22 samples of pass 2


def tensors():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x, x[:, :1] * 1.5 - x[:, 1:2] + 0.1 * torch.randn(N, 1, generator=g, dtype=torch.float64)


class Stream(torch.utils.data.IterableDataset):
    """(x, y, id) in an order of its own each pass; no __len__."""

    def __init__(self):
        self.x, self.y = tensors()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        ids = list(range(N))
        random.Random(100 + self.epoch).shuffle(ids)
        return ((self.x[i], self.y[i], i) for i in ids)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def plan() -> Plan:
    # 5 and 11 samples of every 16: three micro-batches (2, 2, 1) against one
    return Plan(global_batch=B, devices=(DevicePlan(rank=0, device="cpu0", speed=0.5, share=5, micro_batch=2),
                                         DevicePlan(rank=1, device="cpu1", speed=1.0, share=11, micro_batch=11)))


def train(ds, steps, *, ckpt=None, samples=None, collate_fn=None, **init):
    import hetrain

    ht = hetrain.init(global_batch=B, max_steps=steps, reporting=Reporting(verbose=False, sample_log=samples),
                      checkpoints=Checkpoints(dir=ckpt, every=1), **init)
    net = model()
    net, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), ds,
                                   collate_fn=collate_fn)
    out = {"steps": [], "ids": [], "shares": []}
    for step in batches:
        ids = []
        for mb in step:
            with mb:
                x, y = mb.batch[0], mb.batch[1]
                if len(mb.batch) == 3:       # the stream's own ids, to check which sample each position is
                    ids += mb.batch[2].tolist()
                ht.backward(F.mse_loss(net(x), y))
        out["steps"].append(step.index)
        out["ids"].append((list(step.epochs), list(step.indices), ids))
        out["shares"].append(ht.plan.shares)
        ht.step()
    out["params"] = [p.detach().clone() for p in net.parameters()]
    ht.close()
    return out


def reference(ds, steps, *, pick=lambda item: item[:2]):
    """One process, the stream read pass after pass, a step on every B samples."""
    def stream():
        epoch = 0
        while True:
            ds.set_epoch(epoch)
            yield from ds
            epoch += 1

    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    items = stream()
    for _ in range(steps):
        batch = [pick(next(items)) for _ in range(B)]
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()]


def plain_worker(rank, world, steps, ckpt, samples):
    # The plan's shares held: a rebalance read off two plain CPU ranks' timings on a busy host would
    # differ between the uninterrupted and the resumed run, and with it which positions a rank reads.
    return train(Stream(), steps, ckpt=ckpt, samples=samples, plan=plan(), rebalancing=Rebalancing(enabled=False))


def max_diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def cases_worker(rank, world, root):
    """Every job of this file but the resumed one, one after the other in one process group: the
    uninterrupted run, the first 3 steps checkpointed, the datasets stream (if installed), and
    epochs= over a stream (refused, last)."""
    import importlib.util

    from pipeline_runs import join_group

    join_group()
    out = {"uninterrupted": plain_worker(rank, world, STEPS, None, f"{root}/samples"),
           "first": plain_worker(rank, world, 3, f"{root}/ckpt", None)}       # stops at position 48: pass 1, sample 11
    if importlib.util.find_spec("datasets") is not None:
        out["datasets"] = datasets_worker(rank, world)
    out["epochs"] = epochs_worker(rank, world)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: [rank 0's, rank 1's]}; "resumed": the checkpointed run resumed by a new launch."""
    root = tmp_path_factory.mktemp("stream")
    results = run_ranks(cases_worker, 2, str(root), timeout=400)
    out = {case: [r[case] for r in results] for case in results[0]}
    out["resumed"] = run_ranks(plain_worker, 2, STEPS, str(root / "ckpt"), None)   # from the checkpoint at step 3
    return {"root": root, **out}


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return runs["uninterrupted"], str(runs["root"] / "samples")


def test_two_uneven_ranks_over_a_stream_equal_one_process_and_use_every_sample_once_a_pass(uninterrupted):
    from hetrain.runtime.resilience.resume import read_sample_log

    (r0, r1), samples = uninterrupted
    want = reference(Stream(), STEPS)
    for r in (r0, r1):
        assert max_diff(r["params"], want) < 1e-12
    assert [len(r["ids"][0][2]) for r in (r0, r1)] == [5, 11]
    log = read_sample_log(samples)
    assert sorted(log) == list(range(STEPS)) and sum(len(v) for v in log.values()) == STEPS * B
    per_pass: dict[int, list[int]] = {}
    for s in sorted(log):
        for e, position in log[s]:
            per_pass.setdefault(e, []).append(position)
    assert sorted(per_pass[0]) == sorted(per_pass[1]) == list(range(N))     # whole passes: each sample once
    assert per_pass[2] == list(range(STEPS * B - 2 * N))                    # the third pass, from its start
    order = {e: Stream() for e in per_pass}                                 # the sample at each position
    for e, s in order.items():
        s.set_epoch(e)
    for r in (r0, r1):
        for epochs, positions, ids in r["ids"]:
            assert ids == [[i for _, _, i in order[e]][p] for e, p in zip(epochs, positions)]


def test_a_resume_mid_stream_equals_the_uninterrupted_run(runs):
    r0 = runs["uninterrupted"][0]
    first = runs["first"]             # stopped at position 48: pass 1, sample 11
    assert first[0]["steps"] == [0, 1, 2]
    resumed = runs["resumed"]         # a new launch: from the checkpoint at step 3
    assert resumed[0]["steps"] == [3, 4, 5]
    assert resumed[0]["ids"] == r0["ids"][3:]
    for r in resumed:
        assert max_diff(r["params"], r0["params"]) == 0.0


def datasets_worker(rank, world):
    import datasets

    x, y = tensors()

    def gen():
        for i in range(N):
            yield {"x": x[i].tolist(), "y": y[i].tolist()}

    ds = datasets.IterableDataset.from_generator(gen).shuffle(seed=4, buffer_size=8).with_format("torch")

    def collate(items):
        return torch.stack([i["x"] for i in items]).double(), torch.stack([i["y"] for i in items]).double()

    return train(ds, STEPS, collate_fn=collate, emulation=Emulation(cluster="a100-80g,rtx3090"))


def test_a_datasets_stream_from_a_generator_on_a_measured_uneven_plan_equals_one_process(runs):
    datasets = pytest.importorskip("datasets")
    r0, r1 = runs["datasets"]
    assert r0["shares"][0][0] != r0["shares"][0][1]            # the planner's uneven split
    x, y = tensors()

    def gen():
        for i in range(N):
            yield {"x": x[i].tolist(), "y": y[i].tolist()}

    ds = datasets.IterableDataset.from_generator(gen).shuffle(seed=4, buffer_size=8).with_format("torch")
    want = reference(ds, STEPS, pick=lambda item: (item["x"].double(), item["y"].double()))
    for r in (r0, r1):
        assert max_diff(r["params"], want) < 1e-12


def epochs_worker(rank, world):
    from hetrain.errors import UsageError

    try:
        train(Stream(), None, plan=plan(), epochs=2.0)
    except UsageError as e:
        return str(e)
    return "trained"


def test_epochs_over_a_stream_without_a_length_is_one_line_naming_max_steps(runs):
    r0, r1 = runs["epochs"]
    assert r0 == r1 and "\n" not in r0
    assert "epochs=2.0 with an IterableDataset that has no length" in r0 and "max_steps" in r0
