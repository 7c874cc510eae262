"""`hetrain doctor` on recorded machines (tests/fixtures/machines): each must produce its findings.

A machine description is what hetrain.hardware.driver records from torch.cuda and NVML; the
doctor never sees the drivers, so these run the same checks a real machine gets.
"""

from pathlib import Path

import pytest

from hetrain.hardware import doctor, machine
from hetrain.hardware.findings import DoctorOptions

MACHINES = Path(__file__).resolve().parents[2] / "fixtures" / "machines"


def findings_of(name, **options):
    return doctor.run_checks(machine.recorded(str(MACHINES / f"{name}.json")), DoctorOptions(**options))


def levels(findings) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in findings:
        out.setdefault(f.check, set()).add(f.level)
    return out


def one(findings, check):
    hits = [f for f in findings if f.check == check]
    assert len(hits) == 1, hits
    return hits[0]


# machine -> (options, {check: level}) for the checks that matter on it
EXPECTED = {
    "a100_3090_pcie4": (dict(psu_watts=1000), {
        "torch-cuda": "ok", "precision": "ok", "mixed-class": "warn", "p2p": "warn", "pcie-link": "warn",
        "memory": "warn", "power": "ok", "device-order": "warn", "arch": "ok", "versions": "ok",
        "inter-node-network": "ok"}),
    "2x4090_no_p2p": (dict(psu_watts=1000), {
        "p2p": "warn", "mixed-class": "ok", "memory": "ok", "power": "warn", "arch": "ok",
        "device-order": "ok", "precision": "ok"}),
    "v100_a100_sockets": (dict(), {
        "precision": "warn", "topology": "warn", "p2p": "warn", "mixed-class": "ok", "memory": "ok",
        "device-order": "ok", "power": "skipped", "arch": "ok"}),
    "8xa100_sxm_nvlink": (dict(psu_watts=6 * 3000), {
        "nvml": "ok", "torch-cuda": "ok", "gpus": "ok", "precision": "ok", "mixed-class": "ok", "p2p": "ok",
        "topology": "ok", "pcie-link": "ok", "memory": "ok", "power": "ok", "arch": "ok", "versions": "ok",
        "device-order": "ok", "rank-versions": "skipped", "inter-node-network": "ok"}),
    "cpu_only": (dict(), {
        "nvml": "skipped", "torch-cuda": "warn", "gpus": "warn", "precision": "skipped", "p2p": "skipped",
        "power": "skipped", "arch": "skipped", "pcie-link": "skipped", "memory": "skipped",
        "inter-node-network": "skipped"}),
    "2x4090_p2p_broken": (dict(), {"p2p": "error", "versions": "warn"}),
    "5090_old_torch": (dict(), {"arch": "error", "pcie-link": "warn", "device-order": "ok"}),
    "l40s_roce_nccl_2.20": (dict(psu_watts=1200), {
        "torch-cuda": "ok", "versions": "ok", "p2p": "ok", "mixed-class": "ok", "power": "ok", "arch": "ok",
        "inter-node-network": "ok"}),
    "gpus_but_cpu_torch": (dict(), {"torch-cuda": "error", "gpus": "warn", "catalog": "warn", "arch": "skipped"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_machine_produces_its_findings(name):
    options, expected = EXPECTED[name]
    got = levels(findings_of(name, **options))
    assert {check: got.get(check) for check in expected} == {c: {lv} for c, lv in expected.items()}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_finding_is_complete(name):
    for f in findings_of(name, psu_watts=1500):
        assert f.message and f.check
        if f.level in ("warn", "error"):
            assert f.why and f.fix, f


def test_exit_code_follows_errors():
    assert doctor.exit_code(findings_of("a100_3090_pcie4")) == 0
    assert doctor.exit_code(findings_of("cpu_only")) == 0
    assert doctor.exit_code(findings_of("2x4090_p2p_broken")) == 1
    assert doctor.exit_code(findings_of("5090_old_torch")) == 1


def test_seed_workstation_details():
    fs = findings_of("a100_3090_pcie4")
    assert "cuda:1 NVIDIA GeForce RTX 3090 runs PCIe x8 of x16" in one(fs, "pcie-link").message
    assert "cuda:0 is nvidia-smi GPU 1" in one(fs, "device-order").message
    mem = one(fs, "memory")
    assert "23.7 GiB" in mem.message and "79.3 GiB" in mem.message and "30%" in mem.why
    assert "bf16" in one(fs, "precision").message
    # P2P unavailable with a consumer card: disable it on every rank, as the launcher will
    assert dict(one(fs, "p2p").env) == {"NCCL_P2P_DISABLE": "1"}
    fixes = {f.var: f.value for f in doctor.env_fixes(fs, {})}
    assert fixes == {"NCCL_P2P_DISABLE": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_4090s_without_p2p_get_the_nccl_fix():
    p2p = one(findings_of("2x4090_no_p2p"), "p2p")
    assert "NCCL_P2P_DISABLE=1" in p2p.fix and dict(p2p.env) == {"NCCL_P2P_DISABLE": "1"}


def test_broken_p2p_is_an_error_with_the_fix_and_the_driver_is_flagged():
    fs = findings_of("2x4090_p2p_broken")
    p2p = one(fs, "p2p")
    assert p2p.level == "error" and "arrived wrong" in p2p.message and dict(p2p.env) == {"NCCL_P2P_DISABLE": "1"}
    assert "545" in one(fs, "versions").message


def test_user_opt_out_of_p2p_disable_is_kept():
    fs = findings_of("2x4090_no_p2p")
    (fix,) = doctor.env_fixes(fs, {"NCCL_P2P_DISABLE": "0"})
    assert (fix.var, fix.value) == ("NCCL_P2P_DISABLE", "0") and "kept as you set it" in fix.reason


def test_v100_with_a100_across_sockets():
    fs = findings_of("v100_a100_sockets")
    prec = one(fs, "precision")
    assert "Tesla V100-PCIE-32GB (cc 7.0)" in prec.message and "fp16" in prec.message
    assert "in software" in prec.why                 # is_bf16_supported() counts software bf16
    assert "SYS" in one(fs, "topology").message
    p2p = one(fs, "p2p")
    assert p2p.env == ()                             # datacenter cards across sockets: nothing to disable
    # bf16 asked for on this machine is an error naming the V100
    bf16 = one(findings_of("v100_a100_sockets", precision="bf16"), "precision")
    assert bf16.level == "error" and "V100" in bf16.message


def test_dgx_nvlink_is_estimated_from_links():
    m = machine.recorded(str(MACHINES / "8xa100_sxm_nvlink.json"))
    assert len(m.links) == 28 and {ln.code for ln in m.links} == {"NV12"}
    assert {ln.estimated_gbs for ln in m.links} == {300.0}      # 12 links x 25 GB/s per direction
    assert "NV12" in one(doctor.run_checks(m), "topology").message


def test_cpu_only_says_plainly_no_gpu():
    fs = findings_of("cpu_only")
    assert "no GPU is present" in one(fs, "gpus").message
    assert "built without CUDA" in one(fs, "torch-cuda").message
    assert "NVML Shared Library Not Found" in one(fs, "nvml").message


def test_sm_120_missing_from_the_build():
    arch = one(findings_of("5090_old_torch"), "arch")
    assert "sm_120" in arch.message and "cu128" in arch.fix


def test_cpu_torch_on_a_gpu_box_and_an_unknown_gpu():
    fs = findings_of("gpus_but_cpu_torch", psu_watts=1000)
    tc = one(fs, "torch-cuda")
    assert "driver sees 2 GPU(s)" in tc.message and "cu124" in tc.fix
    cat = one(fs, "catalog")
    assert "RTX 4000 Ada Generation" in cat.message and "not in hetrain's GPU catalog" in cat.message
    # the unknown card still counts with its driver power limit
    assert "480 W" in one(fs, "power").message


@pytest.mark.parametrize("psu,level", [(600, "error"), (649, "error"), (650, "warn"), (844.9, "warn"), (845, "ok"), (1600, "ok")])
def test_power_headroom_levels(psu, level):
    # A100 PCIe 300 W + RTX 3090 350 W = 650 W; the seed's 30% headroom needs 845 W
    assert one(findings_of("a100_3090_pcie4", psu_watts=psu), "power").level == level


def test_power_fix_limits_fit_the_psu():
    p = one(findings_of("a100_3090_pcie4", psu_watts=700), "power")
    assert "at least 845 W" in p.fix
    # suggested limits keep 30% headroom: 300*700/845 = 248, 350*700/845 = 289
    assert "-i 1 -pl 248" in p.fix and "-i 0 -pl 289" in p.fix


def test_a_cpu_host_says_whether_it_has_bf16_and_fp16_and_what_that_means_for_emulation(tmp_path):
    import json

    hosts = MACHINES.parent / "hosts"
    facts = json.loads((MACHINES / "cpu_only.json").read_text())
    for host, native, meaning in (("epyc-zen3-avx2", "bf16: no avx512_bf16/amx_bf16", "compute in fp32 here"),
                                  ("xeon-avx512-bf16", "bf16: in hardware", "fp16 compute in fp32 here")):
        facts["cpu_precision"] = json.loads((hosts / f"{host}.json").read_text())
        path = tmp_path / f"{host}.json"
        path.write_text(json.dumps(facts))
        f = one(doctor.run_checks(machine.recorded(str(path)), DoctorOptions()), "precision")
        assert f.level == "ok" and native in f.message and "slower than fp32" in f.message
        assert meaning in f.why
    unmeasured = one(findings_of("cpu_only"), "precision")          # recorded before hosts were measured
    assert unmeasured.level == "skipped" and "unknown" in unmeasured.message and unmeasured.fix
