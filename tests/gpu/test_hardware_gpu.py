"""The hardware layer against real GPUs: discovery matches torch.cuda, NVML answers, bf16 is the
real check, peer copies verify, bandwidth measures. Skipped without CUDA."""

import pytest
import torch

from hetrain.hardware import catalog, doctor, driver, machine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: discovery of real GPUs")]


@pytest.fixture(scope="module")
def live():
    return machine.live(measure=True)


def test_discovery_matches_torch(live):
    cuda = [d for d in live.devices if d.kind == "cuda" and d.visible]
    assert len(cuda) == torch.cuda.device_count()
    for d in cuda:
        props = torch.cuda.get_device_properties(d.index)
        assert d.name == props.name and d.memory_bytes == props.total_memory
        assert d.compute_capability == (props.major, props.minor)
        assert d.uuid and d.uuid.startswith("gpu-")


def test_nvml_answers_on_a_gpu_machine(live):
    assert live.facts["nvml"]["ok"], live.facts["nvml"]["error"]
    assert live.facts["versions"]["driver"] and live.facts["versions"]["nccl"]
    for d in live.gpus:
        assert d.nvml_index is not None and d.pci_bus_id, d    # torch and NVML records matched
        assert d.power_limit_w and d.power_limit_w > 0
        assert d.pcie_width_max and d.pcie_gen_max


def test_real_bf16_is_the_no_emulation_check(live):
    for d in live.gpus:
        with torch.cuda.device(d.index):
            assert d.real_bf16 == torch.cuda.is_bf16_supported(including_emulation=False)


def test_catalog_and_unknown_names_never_fail(live):
    for d in live.gpus:
        spec = catalog.lookup(d.name)
        assert (d.spec is spec) and (spec is not None or "not in hetrain's GPU catalog" in d.notes[0])


def test_doctor_on_this_machine(live):
    findings = {f.check: f for f in doctor.run_checks(live)}
    assert findings["torch-cuda"].level == "ok" and findings["gpus"].level == "ok"
    assert findings["arch"].level in ("ok", "warn"), findings["arch"].message
    want = "bf16" if all(d.real_bf16 for d in live.gpus) else "fp16"
    assert want in findings["precision"].message


def test_measured_bandwidth_and_peer_copies(live):
    for d in live.gpus:
        assert d.h2d_gbs and d.h2d_gbs > 1.0, d     # pinned host-to-device copies: GB/s, not MB/s
    for ln in live.links:
        assert ln.measured_gbs and ln.measured_gbs > 0.5
        if ln.p2p_reported:
            assert ln.p2p_verified is not None


def test_launch_env_fixes_run_for_real():
    fixes = doctor.launch_env_fixes()
    assert all(f.var and f.value is not None and f.reason for f in fixes)


def test_child_query_holds_no_context_here():
    facts = driver.query_machine_in_subprocess()
    assert len([g for g in facts["gpus"] if g.get("cuda_index") is not None]) == torch.cuda.device_count()
