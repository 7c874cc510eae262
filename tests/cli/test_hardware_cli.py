"""`hetrain doctor` and `hetrain env` on the command line: for real on this machine, on recorded
machines, and with bad input (one clear line, exit 2, never a traceback)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fake_nvml
from clirun import hetrain_here
from hetrain.cli import main
from hetrain.hardware.findings import LEVELS

REPO = Path(__file__).resolve().parents[2]
MACHINES = REPO / "tests" / "fixtures" / "machines"
NO_GPU = not torch.cuda.is_available()


def nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def hetrain(*args):
    """The command in this process (clirun.hetrain_here: the exit code and output a user gets, no
    Python start or torch import): doctor and env read this machine, and start nothing."""
    return hetrain_here(*args)


def run_main(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


# -- for real, on this machine -----------------------------------------------------------------
@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the no-GPU wording does not apply")
def test_doctor_runs_here_and_says_no_gpu():
    r = hetrain("doctor")
    assert r.returncode == 0, r.stderr
    assert "no GPU is present" in r.stdout and "Traceback" not in r.stderr
    assert "torch-cuda" in r.stdout and "skipped" in r.stdout


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the no-GPU wording does not apply")
def test_doctor_json_here():
    r = hetrain("doctor", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [d["kind"] for d in out["devices"]] == ["cpu"]
    assert out["findings"] and all({"level", "check", "message", "fix"} <= set(f) for f in out["findings"])
    assert all(f["level"] in LEVELS for f in out["findings"])
    gpus = next(f for f in out["findings"] if f["check"] == "gpus")
    assert gpus["level"] == "warn" and "no GPU is present" in gpus["message"]
    if not nvml_works():           # the driver is missing here: the NVML check is skipped with the reason
        nvml = next(f for f in out["findings"] if f["check"] == "nvml")
        assert nvml["level"] == "skipped" and "NVML" in nvml["message"] and "(" in nvml["message"]


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the no-GPU wording does not apply")
def test_env_runs_here_and_says_no_gpu():
    r = hetrain("env")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Copy-and-paste the text below in your GitHub issue")
    assert "GPUs: none (no GPU is present)" in r.stdout and f"torch: {torch.__version__}" in r.stdout


def test_bad_psu_watts_is_one_line_and_exit_2():
    r = hetrain("doctor", "--psu-watts", "lots")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0] == "hetrain: error: --psu-watts 'lots' is not a positive number of watts"


# -- in this process: recorded machines and bad input ----------------------------------------
@pytest.mark.parametrize("value", ["0", "-500", "nan", "inf", "", "12 volts"])
def test_psu_watts_must_be_a_positive_number(capsys, value):
    code, out, err = run_main(capsys, "doctor", "--machine", str(MACHINES / "cpu_only.json"), "--psu-watts", value)
    assert code == 2 and out == "" and err.startswith("hetrain: error: --psu-watts")


@pytest.mark.parametrize("value,watts", [("1600", "1600 W"), ("1.6kW", "1600 W"), ("1000W", "1000 W")])
def test_psu_watts_units(capsys, value, watts):
    code, out, _ = run_main(capsys, "doctor", "--json", "--machine", str(MACHINES / "a100_3090_pcie4.json"),
                            "--psu-watts", value)
    power = next(f for f in json.loads(out)["findings"] if f["check"] == "power")
    assert watts in power["message"]


def test_json_shape_and_exit_code_on_a_recorded_machine(capsys):
    code, out, _ = run_main(capsys, "doctor", "--json", "--machine", str(MACHINES / "2x4090_p2p_broken.json"))
    data = json.loads(out)
    assert code == 1                                              # an error finding
    assert {"devices", "findings"} <= set(data)
    assert [d["name"] for d in data["devices"]] == ["NVIDIA GeForce RTX 4090"] * 2
    for f in data["findings"]:
        assert {"level", "check", "message", "why", "fix"} <= set(f)
    p2p = next(f for f in data["findings"] if f["check"] == "p2p")
    assert p2p["level"] == "error" and p2p["env"] == {"NCCL_P2P_DISABLE": "1"}


def test_table_output_on_a_recorded_machine(capsys):
    code, out, _ = run_main(capsys, "doctor", "--machine", str(MACHINES / "a100_3090_pcie4.json"))
    assert code == 0
    for needle in ("recorded: a100_3090_pcie4.json", "NVIDIA A100 80GB PCIe", "a100-pcie-80g", "p2p",
                   "NCCL_P2P_DISABLE=1", "pcie-link", "0 error"):
        assert needle in out, needle


def test_planned_cluster_and_an_unknown_alias(capsys):
    code, out, _ = run_main(capsys, "doctor", "--json", "--cluster", "a100-80g,v100", "--psu-watts", "1000")
    data = json.loads(out)
    assert code == 0 and [d["kind"] for d in data["devices"]] == ["planned", "planned"]
    assert next(f for f in data["findings"] if f["check"] == "precision")["level"] == "warn"
    code, out, err = run_main(capsys, "doctor", "--cluster", "a100-80g,rtx9999")
    assert code == 2 and "unknown GPU 'rtx9999'" in err and out == ""


def test_env_of_a_recorded_machine_round_trips_through_doctor(capsys, tmp_path):
    code, out, _ = run_main(capsys, "env", "--json", "--machine", str(MACHINES / "v100_a100_sockets.json"))
    assert code == 0
    path = tmp_path / "recorded.json"
    path.write_text(out)
    code, out, _ = run_main(capsys, "doctor", "--json", "--machine", str(path))
    assert {f["check"]: f["level"] for f in json.loads(out)["findings"]}["topology"] == "warn"


def test_missing_machine_file_and_conflicting_options(capsys, tmp_path):
    code, _, err = run_main(capsys, "doctor", "--machine", str(tmp_path / "nope.json"))
    assert code == 2 and "does not exist" in err
    code, _, err = run_main(capsys, "env", "--machine", str(MACHINES / "cpu_only.json"), "--cluster", "3090")
    assert code == 2 and "--machine and --cluster" in err
    code, _, err = run_main(capsys, "doctor", "--precision", "int8", "--cluster", "3090")
    assert code == 2 and "--precision 'int8'" in err


@pytest.mark.skipif(not NO_GPU, reason="feeds a failing NVML; the CUDA side must be absent")
@pytest.mark.parametrize("broken", ["driver-not-loaded", "not-installed"])
def test_nvml_failing_is_reported_skipped_never_a_crash(capsys, monkeypatch, broken):
    nv = (fake_nvml.make([], init_error=fake_nvml.NVMLError_DriverNotLoaded())
          if broken == "driver-not-loaded" else None)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    code, out, err = run_main(capsys, "doctor", "--json")
    assert code == 0 and "Traceback" not in err
    nvml = next(f for f in json.loads(out)["findings"] if f["check"] == "nvml")
    assert nvml["level"] == "skipped"
    assert ("Driver Not Loaded" if nv else "nvidia-ml-py is not installed") in nvml["message"]
    code, out, _ = run_main(capsys, "env")
    assert code == 0 and "NVML: unavailable" in out


@pytest.mark.dist
def test_doctor_under_torchrun_compares_every_rank(tmp_path):
    from harness import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        f"--master-port={free_port()}", "-m", "hetrain", "doctor", "--json"],
                       capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout)                 # rank 0 alone prints
    ranks = next(f for f in data["findings"] if f["check"] == "rank-versions")
    assert ranks["level"] == "ok" and ranks["message"].startswith("2 ranks agree")
