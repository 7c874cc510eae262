"""The job's state has owners: init()'s Context is frozen (a Config change is a new Context), and
the run state is one RunState, read through the job, written only as job.run.<field>."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hetrain.runtime.config import Config
from hetrain.runtime.job import Context, Job, RunState


def a_job() -> Job:
    dist = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    return Job(Context(config=Config(global_batch=8), dist=dist, log=None, hooks=None, precision=None, faults=None))


def test_the_context_is_frozen_and_a_config_change_is_a_new_context():
    job = a_job()
    before = job.context
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.context.config = Config(global_batch=16)
    with pytest.raises(AttributeError):
        job.config = Config(global_batch=16)
    job.reconfigure(grad_clip=1.0, shuffle=False)
    assert job.context is not before and before.config.grad_clip is None
    assert (job.config.grad_clip, job.config.shuffle, job.device) == (1.0, False, torch.device("cpu"))
    with pytest.raises(ValueError, match="grad_clip"):         # checked as Config(...) checks it
        job.reconfigure(grad_clip=-1.0)


def test_the_run_state_is_one_object_read_through_the_job():
    job = a_job()
    assert isinstance(job.run, RunState) and job.steps_done == 0 and job.plan is None
    for name in ("plan", "sampler", "steps_done", "total_steps", "ooms", "rebalances"):
        with pytest.raises(AttributeError):
            setattr(job, name, 1)
    job.run.steps_done += 2
    assert job.steps_done == 2
