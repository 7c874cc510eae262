"""Every rank's warnings reach the console once: rank 0 prints them with the rank named, the same
text from several ranks as one line listing them, at the step's agreement."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hetrain import Rebalancing, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist


def warning_worker(rank, world):
    import hetrain
    from plans import speed_plan
    from rich.console import Console

    ht = hetrain.init(global_batch=12, max_steps=3, plan=speed_plan(12, (1.0,) * world), emulation=Emulation(cluster=",".join(["a100-80g"] * world)),
                      reporting=Reporting(verbose=False), rebalancing=Rebalancing(enabled=False))
    if rank == 0:
        ht.log.console = Console(file=io.StringIO(), width=400)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(36, 3, generator=g), torch.randn(36, 1, generator=g))
    net = torch.nn.Linear(3, 1)
    model, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data)
    printed_at = []
    for step in batches:
        if step.index == 1:
            ht.log.warn("the same on every rank")
            ht.log.warn(f"only rank {rank} says this")
        for mb in step:
            with mb:
                ht.backward(F.mse_loss(model(mb.batch[0]), mb.batch[1]))
        ht.step()
        if rank == 0:
            printed_at.append(ht.log.console.file.getvalue().count("warning ("))
    ht.close()
    return ht.log.console.file.getvalue().splitlines() if rank == 0 else [], printed_at


def test_identical_warnings_from_several_ranks_are_one_line_and_each_rank_is_named():
    (lines, printed_at), _, _ = run_ranks(warning_worker, 3)
    warnings = [ln for ln in lines if ln.startswith("warning")]
    assert warnings.count("warning (ranks 0, 1, 2): the same on every rank") == 1
    for r in range(3):
        assert warnings.count(f"warning (rank {r}): only rank {r} says this") == 1
    assert len(warnings) == 4
    assert printed_at == [0, 4, 4]          # at the agreement of the step they were raised in
