"""Run accounting across resumes: the sample log keeps each step's latest attempt at any world
size and survives a line cut short; escaped-OOM records reach only the next attempt of their launch."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from hetrain.runtime.resilience import oom
from hetrain.runtime.resilience import resume
from hetrain.runtime.config import Config, Reporting


class FakeJob(SimpleNamespace):   # what log_samples reads of a job; hashed by identity, like Job
    __hash__ = object.__hash__


def attempt(directory, monkeypatch, *, clock, restart, shares):
    """One fake job per rank of an attempt, all agreeing on `clock` as rank 0's time."""
    monkeypatch.setattr(resume, "gather", lambda job, obj: [(clock, restart)])   # rank 0's (clock, restart)
    from hetrain.planning.plan import DevicePlan, Plan

    plan = Plan(global_batch=sum(shares), devices=tuple(
        DevicePlan(rank=r, device=f"d{r}", speed=1.0, share=s, micro_batch=s) for r, s in enumerate(shares)))
    return [FakeJob(rank=r, world_size=len(shares), plan=plan, ctx=SimpleNamespace(restart=restart),
                            config=Config(global_batch=sum(shares), reporting=Reporting(sample_log=str(directory)))) for r in range(len(shares))]


def run_steps(jobs, steps, batch=16):
    for index in steps:
        start = index * batch
        for job in jobs:
            offset = sum(d.share for d in job.plan.devices[:job.rank])
            share = job.plan.devices[job.rank].share
            idx = tuple(range(start + offset, start + offset + share))
            resume.log_samples(job, SimpleNamespace(index=index, epochs=(0,) * share, indices=idx))


def test_a_resume_on_fewer_ranks_and_a_cut_line_give_each_step_once(tmp_path, monkeypatch):
    three = attempt(tmp_path, monkeypatch, clock=100, restart=2, shares=(6, 5, 5))
    run_steps(three, range(6))                            # killed after step 5; its checkpoint is step 4
    with open(tmp_path / "rank1.jsonl", "a") as f:
        f.write('{"step": 6, "attempt": [100, 2], "offs')  # step 6's line, cut short by the kill
    two = attempt(tmp_path, monkeypatch, clock=200, restart=0, shares=(10, 6))   # a new launch: restart 0 again
    run_steps(two, range(4, 10))
    log = resume.read_sample_log(str(tmp_path))
    assert sorted(log) == list(range(10))
    for step, pairs in log.items():
        # every sample of the step once, in global order; rank 2's stale step 4 and 5 are gone
        assert [i for _, i in pairs] == list(range(step * 16, step * 16 + 16)), (step, pairs)
    assert max(Counter(p for ps in log.values() for p in ps).values()) == 1
    # the cut line was ended by the next attempt's first write, so that attempt's first record stayed whole
    assert '"offs\n{"step": 4, "attempt": [200, 0], "offset": 10' in (tmp_path / "rank1.jsonl").read_text()


def test_records_written_before_attempt_keys_still_read(tmp_path):
    (tmp_path / "rank0.jsonl").write_text('{"step": 0, "attempt": 0, "epochs": [0, 0], "indices": [1, 2]}\n'
                                          '{"step": 0, "attempt": 1, "epochs": [0, 0], "indices": [3, 4]}\n')
    (tmp_path / "rank1.jsonl").write_text('{"step": 0, "attempt": 1, "epochs": [0], "indices": [5]}\n')
    assert resume.read_sample_log(str(tmp_path)) == {0: [(0, 3), (0, 4), (0, 5)]}


@pytest.fixture
def run_id(monkeypatch):
    monkeypatch.setenv(oom.RUN_ID_ENV, "launch-a")


def test_an_escaped_oom_reaches_only_the_next_attempt_of_its_launch(tmp_path, run_id, monkeypatch):
    d = str(tmp_path)
    oom.record_escaped_oom(d, rank=1, micro=8, step=5)
    oom.record_escaped_oom(d, rank=3, micro=4, step=5)          # a rank the next run does not have
    assert oom.take_escaped_ooms(d, 2, restart=1) == {1: 8}
    assert oom.take_escaped_ooms(d, 2, restart=0) == {}         # a new launch: not its OOM
    monkeypatch.setenv(oom.RUN_ID_ENV, "launch-b")
    assert oom.take_escaped_ooms(d, 4, restart=1) == {}         # another launch's, even on a restart
    (tmp_path / "oom-rank0.json").write_text('{"micro": ')      # half written: no record
    monkeypatch.setenv(oom.RUN_ID_ENV, "launch-a")
    assert oom.take_escaped_ooms(d, 4, restart=1) == {1: 8, 3: 4}
    oom.clear_escaped_ooms(d)
    assert not list(tmp_path.glob("oom-rank*.json"))
