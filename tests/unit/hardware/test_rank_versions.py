"""Under torchrun, every rank's versions are gathered (real gloo group) and compared."""

from pathlib import Path

import pytest

from harness import run_ranks
from hetrain.hardware import machine, ranks
from hetrain.hardware.checks_software import check_rank_versions
from hetrain.hardware.findings import DoctorOptions

MACHINE = str(Path(__file__).resolve().parents[2] / "fixtures" / "machines" / "2x4090_no_p2p.json")


def _gather(rank, world, nccl_by_rank):
    facts = {"host": {"hostname": f"node{rank}"},
             "versions": {"torch": "2.5.1+cu124", "torch_cuda": "12.4", "nccl": nccl_by_rank[rank],
                          "driver": "550.54.15", "cudnn": 90100},
             "gpus": [{"name": "NVIDIA GeForce RTX 4090"}]}
    assert ranks.under_torchrun()
    got = ranks.gather_rank_versions(facts, timeout_s=60)
    findings = check_rank_versions(machine.recorded(MACHINE), DoctorOptions(rank_versions=got))
    return [(f.level, f.message) for f in findings], got


@pytest.mark.dist
def test_nccl_mismatch_across_ranks_is_an_error_on_every_rank():
    results = run_ranks(_gather, 2, ["2.21.5", "2.18.1"], timeout=120)
    for findings, got in results:
        assert [g["hostname"] for g in got] == ["node0", "node1"]
        assert [g["nccl"] for g in got] == ["2.21.5", "2.18.1"]
        assert findings == [("error", "nccl differs across ranks: rank 0 2.21.5 (node0), rank 1 2.18.1 (node1)")]


def test_comparison_side_by_side():
    rows = ({"nccl": "2.21.5", "torch": "2.5.1", "torch_cuda": "12.4", "driver": "550.54.15", "hostname": "a"},
            {"nccl": "2.18.1", "torch": "2.5.1", "torch_cuda": "12.4", "driver": "550.90.07", "hostname": "b"})
    m = machine.recorded(MACHINE)
    findings = check_rank_versions(m, DoctorOptions(rank_versions=rows))
    by_level = {(f.level, f.message.split(" differs")[0]) for f in findings}
    assert by_level == {("error", "nccl"), ("warn", "driver")}
    nccl = next(f for f in findings if f.message.startswith("nccl"))
    assert "rank 0 2.21.5 (a), rank 1 2.18.1 (b)" in nccl.message and "same torch" in nccl.fix
    same = check_rank_versions(m, DoctorOptions(rank_versions=rows[:1] * 2))
    assert [f.level for f in same] == ["ok"]


def test_not_under_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ranks.gather_rank_versions({}) is None
    assert not ranks.under_torchrun({"WORLD_SIZE": "2"})          # no MASTER_ADDR: not a torchrun rank
    assert ranks.under_torchrun({"WORLD_SIZE": "2", "MASTER_ADDR": "x"})
