"""build_launch checks every input before it measures, writes or launches anything."""

from __future__ import annotations

import pytest

from hetrain import launch
from hetrain.errors import UsageError


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_more_processes_than_gpus_is_refused(monkeypatch, tmp_path, script):
    monkeypatch.setattr(launch, "_cuda_count", lambda: 2)
    monkeypatch.setattr(launch, "launch_env_fixes", lambda env: [])     # no driver asked
    with pytest.raises(UsageError, match="--nproc 3 but 2 GPU"):
        launch.build_launch(target=script, nproc=3, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert launch.build_launch(target=script, nproc=2, run_dir=str(tmp_path / "run")).nproc == 2


def test_without_gpus_any_number_of_cpu_processes(monkeypatch, tmp_path, script):
    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    assert launch.build_launch(target=script, nproc=3, run_dir=str(tmp_path / "run")).nproc == 3


@pytest.mark.parametrize("run_dir", ["train.py", "train.py/sub"])
def test_a_run_dir_that_cannot_be_one_is_refused_first(monkeypatch, tmp_path, script, run_dir):
    measured = []
    monkeypatch.setattr("hetrain.hardware.host.host_facts", lambda: measured.append(1))
    with pytest.raises(UsageError, match="is not a directory"):
        launch.build_launch(target=script, emulate="a100-80g", run_dir=str(tmp_path / run_dir))
    assert not measured                     # before the host is measured


@pytest.mark.parametrize("spec", ["", " ", "1000000000xa100-80g"])
def test_a_bad_emulate_spec_is_refused(script, spec):
    with pytest.raises(UsageError, match="cluster spec"):
        launch.build_launch(target=script, emulate=spec)


def _agent(monkeypatch, run_dir, pcontext):
    """hetrain's agent class, an instance with only what stopping workers uses, and torchrun's
    _start_workers replaced by one that hands it `pcontext` (a recorder of close() calls)."""
    import torch.distributed.launcher.api as launcher_api

    with launch._restarts_only_when_they_can_help(str(run_dir)):
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


def test_one_nodes_part_of_a_node_spec_is_its_emulate_and_its_name():
    assert launch._one_node("node1=4xrtx3090/pcie4", None) == ("4xrtx3090", "node1")
    assert launch._one_node("node1=4xrtx3090/pcie4", "box7") == ("4xrtx3090", "box7")   # --node-name wins


@pytest.mark.parametrize("spec, words", [
    ("a=a100; b=rtx3090; net=25GbE", "names 2 nodes"),
    ("a=a100; net=25GbE", "net="),
    ("a=a100/12GHz", "not understood"),
])
def test_a_node_spec_naming_more_than_this_node_is_refused(script, spec, words):
    with pytest.raises(UsageError, match=words):
        launch.build_launch(target=script, emulate=spec)
