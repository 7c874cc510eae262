"""hetrain's torchrun agent (launching/agent.py): short stop grace after a failure, error records
per attempt, and a node joining told apart from a failure with a fresh read of the rendezvous."""

from __future__ import annotations

import time

import pytest

from hetrain.errors import Preempted
from hetrain.launching import agent as agent_module
from hetrain.launching.agent import nodes_waiting, restarts_only_when_they_can_help
from hetrain.runtime.resilience.worker_errors import write_error


def _agent(monkeypatch, run_dir, pcontext):
    """hetrain's agent class, an instance with only what stopping workers uses, and torchrun's
    _start_workers replaced by one that hands it `pcontext` (a recorder of close() calls)."""
    import torch.distributed.launcher.api as launcher_api

    with restarts_only_when_they_can_help(str(run_dir)):
        agent_class = launcher_api.LocalElasticAgent
    assert launcher_api.LocalElasticAgent is not agent_class          # torchrun's is back

    def start(self, worker_group):
        self._pcontext = pcontext
        return {}

    monkeypatch.setattr(agent_class.__mro__[1], "_start_workers", start)
    agent = agent_class.__new__(agent_class)
    agent._worker_watchdog = agent._health_check_server = None
    agent._start_workers(None)
    return agent


class Closes:
    """A process context as far as its close() goes: records (signal, timeout)."""

    def __init__(self, *exit_codes):
        self._failures = {r: type("Failure", (), {"exitcode": c})() for r, c in enumerate(exit_codes)}
        self.calls = []

    def close(self, death_sig=None, timeout=30):
        self.calls.append((death_sig, timeout))


@pytest.mark.parametrize("codes, timeout", [((1,), 5), ((-9, 75), 5), ((75, 75), 30), ((), 30)])
def test_the_context_closing_itself_after_a_failure_waits_a_short_grace(monkeypatch, tmp_path, codes, timeout):
    """torchrun's process context closes itself (SIGTERM, wait, SIGKILL) when a worker fails: with a
    failed worker (an error, a kill) nothing can be saved and a hung one would take the whole 30 s,
    so the wait is short; workers that stopped at a step boundary (exit 75, Preempted) or all done
    keep torchrun's 30 s. A close with its own timeout (the launcher signalled: --shutdown-timeout)
    keeps it."""
    pcontext = Closes(*codes)
    _agent(monkeypatch, tmp_path, pcontext)
    pcontext.close()                                  # as PContext._poll calls it
    pcontext.close("SIGTERM", 90)                     # as the agent's _shutdown calls it
    assert pcontext.calls == [(None, timeout), ("SIGTERM", 90)]


@pytest.mark.parametrize("state, timeout", [("FAILED", 5), ("UNHEALTHY", 5), ("HEALTHY", 30)])
def test_a_group_with_a_failed_member_is_stopped_after_a_short_grace(monkeypatch, tmp_path, state, timeout):
    """torchrun stops a group (SIGTERM, then SIGKILL after the wait) before a restart or at the end.
    With a failed member nothing can be saved, and a hung (SIGSTOPped) worker would take torchrun's
    whole 30 s: the short grace. A healthy group (a node joining; the workers save at the step
    boundary) keeps torchrun's own stop and wait."""
    import signal

    from torch.distributed.elastic.agent.server.api import WorkerState

    pcontext = Closes()
    agent = _agent(monkeypatch, tmp_path, pcontext)
    group = type("Group", (), {"state": WorkerState[state]})()
    agent._stop_workers(group)
    assert pcontext.calls == [(signal.SIGTERM, timeout)]


class Rendezvous:
    """num_nodes_waiting() as torch's handler answers it: from a cached copy, fresh only after
    `stale` reads (the joiner is already on the wait list, the copy does not show it yet)."""

    def __init__(self, stale: int, waiting: int = 1, fails: bool = False):
        self.stale, self.waiting, self.fails, self.reads = stale, waiting, fails, 0

    def num_nodes_waiting(self) -> int:
        self.reads += 1
        if self.fails:
            raise ConnectionError("store gone")
        return self.waiting if self.reads > self.stale else 0


def test_a_joiner_the_cached_copy_does_not_show_yet_is_seen():
    """The failure CI showed: another node's agent saw the joiner and stopped its workers; ours
    stopped with them at the saved step, and one read of the 1 s cached copy said nobody waits,
    so the job ended with exit 75. Reading again over the cache's span sees the joiner."""
    handler = Rendezvous(stale=3)
    assert nodes_waiting(handler, within_s=2.0, poll_s=0.01)
    assert handler.reads == 4


@pytest.mark.parametrize("handler", [Rendezvous(stale=0, waiting=0), Rendezvous(stale=0, fails=True)])
def test_nobody_waiting_or_a_rendezvous_that_cannot_say_is_no_joiner(handler):
    assert not nodes_waiting(handler, within_s=0.05, poll_s=0.01)
    assert handler.reads >= (1 if handler.fails else 2)    # a failing store is not asked again


class StaleFor:
    """num_nodes_waiting() from a copy that shows the joiner only `seconds` after the first read,
    as torch's cached copy does when the joiner came just after this agent's last fresh read."""

    def __init__(self, seconds: float):
        self.seconds, self.first = seconds, None

    def num_nodes_waiting(self) -> int:
        self.first = self.first or time.monotonic()
        return int(time.monotonic() - self.first >= self.seconds)


def test_by_default_the_check_outlasts_the_rendezvous_cache():
    """With its default span the check sees a joiner that the cache hides for its whole second."""
    assert nodes_waiting(StaleFor(agent_module.RDZV_STATE_CACHE_S + 0.05))


def _record(run_dir, rank):
    """A worker's record of a stop at a saved step, written as a worker writes it."""
    write_error(str(run_dir), rank, Preempted("preempted (SIGTERM on rank 0)", "run the same command to resume"))


def test_error_records_are_cleared_when_the_next_attempts_workers_start(monkeypatch, tmp_path):
    """A worker stopped for a restart writes its record while it stops: cleared before the next
    workers start (not before the stop), so the next attempt never reads it as its own."""
    from hetrain.runtime.resilience.worker_errors import read_errors

    agent = _agent(monkeypatch, tmp_path, Closes())
    seen = []
    monkeypatch.setattr(type(agent).__mro__[1], "_initialize_workers",
                        lambda self, group: seen.append(read_errors(str(tmp_path))))
    _record(tmp_path, 0)                        # written by the stopped worker, after any earlier clear
    agent._initialize_workers(None)
    assert seen == [[]]


@pytest.mark.parametrize("stale, healthy, restarts_left", [(2, True, 2), (10**6, False, 0)])
def test_workers_stopped_together_for_a_joiner_are_a_membership_change(monkeypatch, tmp_path, stale,
                                                                       healthy, restarts_left):
    """Every worker Preempted and a node waiting (seen only on a later read): healthy, no restart
    used. Preempted with nobody waiting (a real preemption): the job ends, restarts set to 0."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    monkeypatch.setattr(agent_module.nodes_waiting, "__kwdefaults__", {"within_s": 0.3, "poll_s": 0.01})
    agent = _agent(monkeypatch, tmp_path, Closes())
    monkeypatch.setattr(type(agent).__mro__[1], "_monitor_workers",
                        lambda self, group: RunResult(state=WorkerState.FAILED))
    agent._remaining_restarts = 2
    _record(tmp_path, 0)
    handler = Rendezvous(stale=stale)
    group = type("Group", (), {"spec": type("Spec", (), {"rdzv_handler": handler})()})()
    result = agent._monitor_workers(group)
    assert (result.state == WorkerState.HEALTHY) == healthy
    assert agent._remaining_restarts == restarts_left
