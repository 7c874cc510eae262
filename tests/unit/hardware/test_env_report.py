"""`hetrain env`'s report: header, versions, every device, topology matrix, environment."""

from pathlib import Path

from hetrain.hardware import envreport, machine

MACHINES = Path(__file__).resolve().parents[2] / "fixtures" / "machines"


def test_report_of_a_mixed_workstation():
    m = machine.recorded(str(MACHINES / "a100_3090_pcie4.json"))
    text = envreport.render_text(m)
    assert text.startswith("Copy-and-paste the text below in your GitHub issue")
    assert "python -m torch.utils.collect_env" in text
    for needle in ("torch: 2.5.1+cu121", "NCCL: 2.21.5", "NVIDIA driver: 535.154.05 (supports CUDA 12.2)",
                   "torch arch list: sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90",
                   "- cuda:0: NVIDIA A100 80GB PCIe", "- cuda:1: NVIDIA GeForce RTX 3090",
                   "PCI bus id: 00000000:01:00.0; nvidia-smi index: 0", "PCIe: gen1 x8 now, gen4 x16 max",
                   "cuda:0  X           PHB p2p:NO", "OMP_NUM_THREADS=8"):
        assert needle in text, needle
    assert text.count("uuid: gpu-") == 2


def test_report_of_the_dgx_has_a_full_matrix():
    text = envreport.render_text(machine.recorded(str(MACHINES / "8xa100_sxm_nvlink.json")))
    rows = [ln for ln in text.splitlines() if ln.startswith("  cuda:") and "NV12" in ln and "X" in ln]
    assert len(rows) == 8 and all(r.count("NV12 p2p:ok") == 7 for r in rows)
    assert "NCCL_SOCKET_IFNAME=ib0" in text


def test_report_without_gpus_says_so():
    text = envreport.render_text(machine.recorded(str(MACHINES / "cpu_only.json")))
    assert "GPUs: none (no GPU is present)" in text and "NVML: unavailable: NVMLError_LibraryNotFound" in text
    assert "none set" in text


def test_json_report_is_a_recordable_machine(tmp_path):
    import json

    m = machine.recorded(str(MACHINES / "v100_a100_sockets.json"))
    out = envreport.render_json(m)
    assert set(out) == {"machine", "devices", "topology", "env"}
    assert [d["label"] for d in out["devices"]] == ["cuda:0", "cuda:1"] and out["topology"][0]["code"] == "SYS"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(out))
    again = machine.recorded(str(path))                       # `hetrain doctor --machine` reads it back
    assert [d.name for d in again.devices] == [d.name for d in m.devices]


def test_planned_cluster_report():
    text = envreport.render_text(machine.planned("a100-80g,rtx3090"))
    assert "planned cluster" in text and "- a100-80g#0: NVIDIA A100 80GB SXM" in text and "planned: speed 0.67" in text


def test_report_lists_every_rank_under_torchrun():
    m = machine.recorded(str(MACHINES / "2x4090_no_p2p.json"))
    rows = ({"hostname": "a", "torch": "2.4.1", "torch_cuda": "12.4", "nccl": "2.20.5", "driver": "550.54.15",
             "gpus": ["NVIDIA GeForce RTX 4090"]},
            {"hostname": "b", "torch": "2.4.1", "torch_cuda": "12.4", "nccl": "2.20.5", "driver": "550.54.15",
             "gpus": []})
    text = envreport.render_text(m, rows)
    assert "Ranks (2):" in text and "rank 1: host b; torch 2.4.1" in text and "GPUs none" in text
    assert envreport.render_json(m, rows)["ranks"][0]["hostname"] == "a"


def test_report_on_a_cpu_host_gives_its_bf16_fp16_speeds_and_what_emulation_does(tmp_path):
    import json

    facts = json.loads((MACHINES / "cpu_only.json").read_text())
    facts["cpu_precision"] = json.loads((MACHINES.parent / "hosts" / "epyc-zen3-avx2.json").read_text())
    path = tmp_path / "m.json"
    path.write_text(json.dumps(facts))
    text = envreport.render_text(machine.recorded(str(path)))
    line = next(ln for ln in text.splitlines() if ln.startswith("- CPU precision:"))
    assert "no avx512_bf16/amx_bf16" in line and "39x slower than fp32" in line and "flags: avx2" in line
    assert "block 9.5/372.0/365.0" in text and "precision rule: under precision='auto'" in text
