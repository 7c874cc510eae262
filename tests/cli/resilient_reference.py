"""scripts/resilient_train.py's job as one process trains it, computed here (no launch): the stream
of samples one process draws (the runtime's global-cursor sampler, seeded as the job is), each
step's whole global batch in one backward, the script's model, data, AdamW and LR schedule.

A job under test must log exactly these samples, step by step (`assert_samples_of_one_process`),
and end with these parameters: any world size, split, restart or resume (big-batch math)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from hetrain.runtime.loop.sampler import GlobalCursorSampler
from hetrain.runtime.resilience.resume import read_sample_log

N, GLOBAL_BATCH = 40, 16     # the script's dataset and global batch


def _stream(steps: int):
    stream = GlobalCursorSampler(N, GLOBAL_BATCH, seed=0)
    return [stream.next_step() for _ in range(steps)]


@lru_cache(maxsize=None)
def one_process(steps: int, width: int = 32) -> tuple[torch.Tensor, ...]:
    """The parameters after `steps` steps, in the script's order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = x.sum(1, keepdim=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for drawn in _stream(steps):
        idx = list(drawn.indices)
        loss = F.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    return tuple(q.detach().clone() for q in model.parameters())


def assert_samples_of_one_process(ckpt: Path, steps: int) -> None:
    """The job's sample log (CKPT/samples) holds, step by step, the samples one process draws."""
    logged = read_sample_log(str(ckpt / "samples"))
    assert sorted(logged) == list(range(steps))
    for drawn in _stream(steps):
        got = sorted(map(tuple, logged[drawn.step]))
        assert got == sorted(zip(drawn.epochs, drawn.indices)), (drawn.step, got, drawn)
