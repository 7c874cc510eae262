"""The launcher applies the doctor's environment fixes on GPU machines, and says which."""

import json
from pathlib import Path

import pytest

from hetrain import launch
from hetrain.hardware import doctor, driver

MACHINES = Path(__file__).resolve().parents[2] / "fixtures" / "machines"


def recorded(name):
    return json.loads((MACHINES / f"{name}.json").read_text())


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def gpu_launch(monkeypatch, tmp_path, script, facts=None, error=None):
    seen = {}

    def fake_query(*, environ=None, timeout_s=120.0):
        seen["environ"] = environ
        if error:
            raise error
        return facts

    monkeypatch.setattr(launch, "_cuda_count", lambda: 2)
    monkeypatch.setattr(driver, "query_machine_in_subprocess", fake_query)
    return launch.build_launch(target=script, run_dir=str(tmp_path / "run")), seen


def test_p2p_fix_is_applied_with_a_reason(monkeypatch, tmp_path, script):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    lch, seen = gpu_launch(monkeypatch, tmp_path, script, recorded("2x4090_no_p2p"))
    assert lch.env["NCCL_P2P_DISABLE"] == "1" and lch.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert any(r.startswith("NCCL_P2P_DISABLE=1: doctor [p2p]") for r in lch.reasons)
    assert seen["environ"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"       # checked as the job will run
    assert "NCCL_P2P_DISABLE=1" in lch.describe()


def test_launchers_own_settings_are_not_repeated(monkeypatch, tmp_path, script):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    lch, _ = gpu_launch(monkeypatch, tmp_path, script, recorded("a100_3090_pcie4"))
    assert sum("CUDA_DEVICE_ORDER" in r for r in lch.reasons) == 1
    assert lch.env["NCCL_P2P_DISABLE"] == "1"


def test_user_opt_out_is_kept_and_said(monkeypatch, tmp_path, script):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    lch, _ = gpu_launch(monkeypatch, tmp_path, script, recorded("2x4090_p2p_broken"))
    assert lch.env["NCCL_P2P_DISABLE"] == "0"
    assert any("kept as you set it" in r for r in lch.reasons)


def test_healthy_machine_gets_no_extra_settings(monkeypatch, tmp_path, script):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    lch, _ = gpu_launch(monkeypatch, tmp_path, script, recorded("8xa100_sxm_nvlink"))
    assert set(lch.env) == {"CUDA_DEVICE_ORDER", "HETRAIN_LAUNCH", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert lch.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_a_failed_query_does_not_stop_the_launch(monkeypatch, tmp_path, script, caplog):
    lch, _ = gpu_launch(monkeypatch, tmp_path, script, error=RuntimeError("child died"))
    assert "NCCL_P2P_DISABLE" not in lch.env and "CUDA_DEVICE_ORDER" in lch.env
    assert "machine checks skipped before launch (RuntimeError: child died)" in caplog.text


def test_no_gpu_no_query(monkeypatch, tmp_path, script):
    monkeypatch.setattr(launch, "_cuda_count", lambda: 0)
    monkeypatch.setattr(driver, "query_machine_in_subprocess",
                        lambda **k: pytest.fail("the machine must not be queried without a GPU"))
    lch = launch.build_launch(target=script, run_dir=str(tmp_path / "run"))
    assert "NCCL_P2P_DISABLE" not in lch.env


def test_launch_env_fixes_reads_the_given_environment(monkeypatch):
    monkeypatch.setattr(driver, "query_machine_in_subprocess", lambda **k: recorded("2x4090_no_p2p"))
    assert doctor.launch_env_fixes({"NCCL_P2P_DISABLE": "1"})[0].reason.startswith("NCCL_P2P_DISABLE=1: kept")
    (fix,) = doctor.launch_env_fixes({})
    assert (fix.var, fix.value) == ("NCCL_P2P_DISABLE", "1")
