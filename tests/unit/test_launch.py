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


@pytest.mark.parametrize("state, timeout", [("FAILED", 5), ("UNHEALTHY", 5), ("HEALTHY", 30)])
def test_a_group_with_a_failed_member_is_stopped_after_a_short_grace(tmp_path, state, timeout):
    """torchrun stops a group (SIGTERM, then SIGKILL after the wait) before a restart or at the end.
    With a failed member nothing can be saved, and a hung (SIGSTOPped) worker would take torchrun's
    whole 30 s: the short grace. A healthy group (a node joining; the workers save at the step
    boundary) keeps torchrun's own stop and wait."""
    import signal

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.api import WorkerState

    with launch._restarts_only_when_they_can_help(str(tmp_path)):
        agent_class = launcher_api.LocalElasticAgent
    assert launcher_api.LocalElasticAgent is not agent_class          # torchrun's is back
    agent = agent_class.__new__(agent_class)                          # only what _stop_workers uses
    agent._worker_watchdog = agent._health_check_server = None
    closed = []
    agent._pcontext = type("PContext", (), {"close": lambda self, sig, t: closed.append((sig, t))})()
    group = type("Group", (), {"state": WorkerState[state]})()
    agent._stop_workers(group)
    assert closed == [(signal.SIGTERM, timeout)]
