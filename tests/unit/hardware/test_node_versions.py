"""Cross-node version comparison: each rank's versions (from a recorded machine through
HETRAIN_MACHINE, or from this machine) compared across nodes; torch, CUDA or NCCL differing is a
one-line error naming the odd node, a driver difference a warning."""

from pathlib import Path

import pytest
import torch

from hetrain.errors import UsageError
from hetrain.hardware import driver, ranks
from hetrain.hardware.node_versions import MACHINE_ENV, check_node_versions, versions_here

MACHINES = Path(__file__).resolve().parents[2] / "fixtures" / "machines"


def recorded(name):
    """A rank's versions as a rank on that recorded machine sees them."""
    return versions_here({MACHINE_ENV: str(MACHINES / f"{name}.json")})


def error_of(per_rank, node_of, names):
    with pytest.raises(UsageError) as e:
        check_node_versions(per_rank, node_of, names)
    assert "\n" not in e.value.what and "\n" not in e.value.fix
    return e.value


def test_versions_here_reads_the_recorded_machine():
    v = recorded("5090_old_torch")
    assert v == ranks.rank_versions(driver.load_machine(str(MACHINES / "5090_old_torch.json")))
    assert (v["torch"], v["torch_cuda"], v["nccl"], v["driver"]) == ("2.5.1+cu124", "12.4", "2.21.5", "570.124.04")
    assert v["hostname"] == "ws-5090" and v["gpus"] == ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 3090"]


def test_versions_here_names_the_variable_of_a_missing_file(tmp_path):
    with pytest.raises(UsageError) as e:
        versions_here({MACHINE_ENV: str(tmp_path / "nope.json")})
    assert e.value.what.startswith(f"{MACHINE_ENV}=") and "does not exist" in e.value.what


def test_versions_here_matches_the_full_machine_query(monkeypatch):
    """The cheap path and the full description (driver.query_machine) agree on this machine."""
    monkeypatch.delenv(MACHINE_ENV, raising=False)
    here = versions_here()
    full = ranks.rank_versions(driver.query_machine())
    assert {k: here[k] for k in ranks.FIELDS} == {k: full[k] for k in ranks.FIELDS}
    assert here["torch"] == torch.__version__ and here["torch_cuda"] == torch.version.cuda
    assert here["hostname"] == full["hostname"]


def test_the_same_versions_everywhere_pass():
    dgx = recorded("8xa100_sxm_nvlink")
    assert check_node_versions([dgx, dgx, dgx], [0, 0, 1], ["dgx-a", "dgx-b"]) == []


def test_nccl_differing_under_the_same_torch_names_the_node_and_the_install():
    dgx, l40s = recorded("8xa100_sxm_nvlink"), recorded("l40s_roce_nccl_2.20")
    e = error_of([dgx, dgx, l40s, l40s], [0, 0, 1, 1], ["dgx-a100", "l40s-roce"])
    assert e.what.startswith("NCCL differs across nodes: ")
    assert ("node 0 'dgx-a100' NCCL 2.21.5, driver 550.90.07; node 1 'l40s-roce' NCCL 2.20.5, driver 550.127.05"
            in e.what)
    assert "(node 1 'l40s-roce' is the odd one)" in e.what and "nccl#1267" in e.what
    assert e.fix.startswith("install torch 2.5.1+cu124 (CUDA 12.4, NCCL 2.21.5) on node 1 'l40s-roce', "
                            "as on node 0 'dgx-a100'")
    assert "pip install nvidia-nccl-cu12==2.21.5" in e.fix


def test_the_minority_node_is_the_odd_one():
    l40s, dgx, ws = recorded("l40s_roce_nccl_2.20"), recorded("8xa100_sxm_nvlink"), recorded("5090_old_torch")
    e = error_of([l40s, dgx, ws], [0, 1, 2], ["a", "b", "c"])
    assert "(node 0 'a' is the odd one)" in e.what and "on node 0 'a', as on node 1 'b'" in e.fix


def test_torch_and_nccl_differ_on_a_tie_the_node_unlike_node_0_is_odd():
    ws, box = recorded("5090_old_torch"), recorded("2x4090_no_p2p")
    e = error_of([ws, box], [0, 1], ["ws-5090", "box-4090"])
    assert e.what.startswith("torch and NCCL differ across nodes: node 0 'ws-5090' torch 2.5.1+cu124, NCCL 2.21.5")
    assert "node 1 'box-4090' torch 2.4.1+cu124, NCCL 2.20.5" in e.what
    assert e.fix.startswith("install torch 2.5.1+cu124 (CUDA 12.4, NCCL 2.21.5) on node 1 'box-4090'")
    assert "nvidia-nccl" not in e.fix            # a different torch: installing torch brings its NCCL


def test_a_driver_difference_alone_is_a_warning():
    dgx, ws = recorded("8xa100_sxm_nvlink"), recorded("5090_old_torch")
    (warning,) = check_node_versions([dgx, ws], [0, 1], ["dgx-a100", "ws-5090"])
    assert warning.startswith("the NVIDIA driver differs across nodes: node 0 'dgx-a100' driver 550.90.07; "
                              "node 1 'ws-5090' driver 570.124.04 (node 1 'ws-5090' is the odd one)")
    assert "\n" not in warning and "install driver 550.90.07 on node 1 'ws-5090'" in warning


def test_a_cpu_torch_build_beside_cuda_builds_is_a_mismatch():
    cpu_build, l40s = recorded("gpus_but_cpu_torch"), recorded("l40s_roce_nccl_2.20")
    e = error_of([l40s, cpu_build], [0, 1], ["l40s-roce", "l40s-node"])
    assert e.what.startswith("torch and CUDA differ across nodes: ")
    assert "node 1 'l40s-node' torch 2.5.1+cpu, CUDA none (CPU build)" in e.what
    assert "install torch 2.5.1+cu124 (CUDA 12.4, NCCL 2.20.5) on node 1 'l40s-node'" in e.fix


def test_unknown_nccl_and_driver_compare_equal():
    cpu = recorded("cpu_only")
    assert check_node_versions([cpu, cpu], [0, 1], ["ci-a", "ci-b"]) == []
    dgx = recorded("8xa100_sxm_nvlink")
    unknown = {**dgx, "nccl": None, "driver": None}       # e.g. a CUDA build whose GPU did not answer
    assert check_node_versions([dgx, unknown], [0, 1], ["a", "b"]) == []


def test_ranks_of_one_node_must_share_one_install():
    ws, box = recorded("5090_old_torch"), recorded("2x4090_no_p2p")
    e = error_of([ws, box, ws], [0, 0, 1], ["ws", "other"])
    assert e.what.startswith("ranks on node 0 'ws' run different torch: rank 0 2.5.1+cu124, rank 1 2.4.1+cu124")
    assert "same Python environment" in e.fix


def test_mismatched_arguments_are_a_programming_error():
    v = recorded("cpu_only")
    with pytest.raises(ValueError):
        check_node_versions([v, v], [0], ["a"])
    with pytest.raises(ValueError):
        check_node_versions([v], [1], ["a"])
