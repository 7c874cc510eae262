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


def _torchrun_parser_without_shutdown_timeout(real):
    """torchrun's argument parser as torch 2.11 has it: the installed one less --shutdown-timeout
    (added in 2.12)."""
    def parser():
        p = real()
        for action in [a for a in p._actions if "--shutdown-timeout" in a.option_strings]:   # none on 2.11
            p._remove_action(action)
            for option in action.option_strings:
                del p._option_string_actions[option]
        return p
    return parser


def test_a_torchrun_without_shutdown_timeout_gets_a_command_it_accepts(monkeypatch, tmp_path, script):
    """On torch 2.11 every `hetrain run` failed at launch: 'unrecognized arguments:
    --shutdown-timeout=90'. The command leaves the flag out where torchrun lacks it (the agent
    gives the wait instead: launching/agent.py) and says so."""
    import torch.distributed.run as torchrun

    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    monkeypatch.setattr(torchrun, "get_args_parser", _torchrun_parser_without_shutdown_timeout(torchrun.get_args_parser))
    built = launch.build_launch(target=script, nproc=2, run_dir=str(tmp_path / "run"))
    args = torchrun.parse_args(list(built.argv[3:]))       # what run_launch hands torchrun: exits on a bad flag
    assert args.nproc_per_node == "2" and not hasattr(args, "shutdown_timeout")
    assert not any(a.startswith("--shutdown-timeout") for a in built.argv)
    assert built.shutdown_s == launch.PREEMPT_SHUTDOWN_S
    assert f"waits {launch.PREEMPT_SHUTDOWN_S} s" in built.describe()


@pytest.mark.skipif(not launch.torchrun_takes_shutdown_timeout(),
                    reason="this torch's torchrun (before 2.12) has no --shutdown-timeout; the test above covers such a torch")
def test_a_torchrun_with_shutdown_timeout_is_given_the_preemption_wait(monkeypatch, tmp_path, script):
    import torch.distributed.run as torchrun

    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    built = launch.build_launch(target=script, nproc=2, run_dir=str(tmp_path / "run"))
    assert torchrun.parse_args(list(built.argv[3:])).shutdown_timeout == launch.PREEMPT_SHUTDOWN_S
