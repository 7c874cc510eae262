"""hetrain's torchrun agent (launching/agent.py): short stop grace after a failure, error records
per attempt, and a node joining told apart from a failure with a fresh read of the rendezvous."""

from __future__ import annotations

import time

import pytest

from hetrain.errors import Preempted
from hetrain.launching import agent as agent_module
from hetrain.launching.agent import nodes_waiting, restarts_only_when_they_can_help
from hetrain.runtime.resilience.worker_errors import write_error


def _agent(monkeypatch, run_dir, pcontext, *, base=None, shutdown_s=30):
    """hetrain's agent class, an instance with only what stopping workers uses, and torchrun's
    _start_workers replaced by one that hands it `pcontext` (a recorder of close() calls).
    `base`: the torchrun agent class it is made on (default: the installed torch's)."""
    import torch.distributed.launcher.api as launcher_api

    if base is not None:
        monkeypatch.setattr(launcher_api, "LocalElasticAgent", base)
    with restarts_only_when_they_can_help(str(run_dir), shutdown_s=shutdown_s):
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


def _agent_of_torch_2_11():
    """torchrun's agent as torch 2.11 has it: _shutdown takes the signal alone (no timeout), and
    its process context's close gets no wait (it waits its own 30 s)."""
    import signal

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent211(LocalElasticAgent):
        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM) -> None:
            if self._pcontext:
                self._pcontext.close(death_sig)
    return Agent211


@pytest.mark.parametrize("state, timeout", [("FAILED", 5), ("UNHEALTHY", 5), ("HEALTHY", 90)])
def test_on_torch_2_11_s_agent_a_failed_group_still_stops_after_the_short_grace(monkeypatch, tmp_path, state,
                                                                                timeout):
    """torch 2.11's agent._shutdown has no timeout: the failed group's stop used to raise TypeError
    there (every failure under `hetrain run` became a launcher traceback). The grace reaches the
    process context's close instead; a healthy group's stop waits --shutdown-timeout's time."""
    import signal

    from torch.distributed.elastic.agent.server.api import WorkerState

    pcontext = Closes()
    agent = _agent(monkeypatch, tmp_path, pcontext, base=_agent_of_torch_2_11(), shutdown_s=90)
    agent._stop_workers(type("Group", (), {"state": WorkerState[state]})())
    assert pcontext.calls == [(signal.SIGTERM, timeout)]


def test_on_torch_2_11_s_agent_a_signal_stop_waits_the_launch_s_shutdown_time(monkeypatch, tmp_path):
    """torchrun 2.11 has no --shutdown-timeout: after SIGTERM (a preemption) its agent calls
    _shutdown(signal) and would kill the workers after 30 s, before their checkpoint is written.
    hetrain's agent gives that close the launch's wait; later calls go back to torchrun's."""
    import signal

    pcontext = Closes()
    agent = _agent(monkeypatch, tmp_path, pcontext, base=_agent_of_torch_2_11(), shutdown_s=90)
    agent._shutdown(signal.SIGINT)                 # as 2.11's run() calls it on a signal
    pcontext.close()                               # the context closing itself later: no failure, 30 s
    assert pcontext.calls == [(signal.SIGINT, 90), (None, 30)]


def _installed_agent_takes_a_timeout() -> bool:
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return "timeout" in inspect.signature(LocalElasticAgent.__dict__["_shutdown"]).parameters


@pytest.mark.skipif(not _installed_agent_takes_a_timeout(), reason="this torch's agent._shutdown has no timeout (2.11)")
def test_on_an_agent_with_shutdown_timeout_the_wait_passes_through(monkeypatch, tmp_path):
    """torch 2.12+: _shutdown's timeout goes to torch's own (its default 30 s when none is given)."""
    import signal

    pcontext = Closes()
    agent = _agent(monkeypatch, tmp_path, pcontext, shutdown_s=90)
    agent._shutdown(signal.SIGTERM, timeout=90)
    agent._shutdown()
    assert pcontext.calls == [(signal.SIGTERM, 90), (signal.SIGTERM, 30)]


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
