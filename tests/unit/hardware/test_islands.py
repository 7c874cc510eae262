"""Device kinds beyond NVIDIA, and islands: the catalog's vendors, the island form of a cluster
spec and its bridge, the job's islands from every rank's device, versions compared per island."""

import pytest

from hetrain.errors import UsageError
from hetrain.hardware import catalog, islands
from hetrain.hardware.cluster import parse_cluster_spec
from hetrain.hardware.devices import from_cluster_device
from hetrain.hardware.node_versions import check_node_versions
from hetrain.runtime.ranks.island_facts import job_islands, rank_device

SPEC = "nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi; bridge=host:25GbE"


@pytest.mark.parametrize("name,vendor,device_type,backend,collective", [
    ("AMD Instinct MI300X", "amd", "cuda", "nccl", "rccl"),
    ("AMD Instinct MI250X", "amd", "cuda", "nccl", "rccl"),
    ("mi210", "amd", "cuda", "nccl", "rccl"),
    ("AMD Radeon RX 7900 XTX", "amd", "cuda", "nccl", "rccl"),
    ("w7900", "amd", "cuda", "nccl", "rccl"),
    ("GAUDI2", "intel", "hpu", "hccl", "hccl"),
    ("gaudi3", "intel", "hpu", "hccl", "hccl"),
    ("Intel(R) Data Center GPU Max 1550", "intel", "xpu", "xccl", "xccl"),
    ("Ascend910B3", "huawei", "npu", "hccl", "hccl"),
    ("cpu", "cpu", "cpu", "gloo", "gloo"),
    ("a100-80g", "nvidia", "cuda", "nccl", "nccl"),
])
def test_the_catalog_knows_each_vendors_device_type_and_library(name, vendor, device_type, backend, collective):
    g = catalog.resolve(name)
    assert (g.vendor, g.device_type, g.backend, g.collective) == (vendor, device_type, backend, collective)


def test_bf16_is_explicit_off_nvidia_and_unchanged_on_it():
    assert catalog.resolve("mi300x").real_bf16 and catalog.resolve("mi300x").compute_capability == (0, 0)
    assert catalog.resolve("mi300x").precision_capability == (8, 0)
    cpu = catalog.resolve("cpu")
    assert cpu.real_bf16 and not cpu.fp16 and cpu.fp16_tflops == 0
    assert not catalog.resolve("v100").real_bf16 and catalog.resolve("v100").precision_capability == (7, 0)
    # an emulated AMD card has no compute capability, but bf16 from its catalog flag
    d = from_cluster_device(parse_cluster_spec("mi300x").devices[0])
    assert d.compute_capability is None and d.real_bf16 is True


def test_datasheet_figures_and_speeds_on_the_a100_scale():
    mi300x, gaudi2, cpu = catalog.resolve("mi300x"), catalog.resolve("gaudi2"), catalog.resolve("cpu")
    assert (mi300x.bf16_tflops, mi300x.memory_bytes, mi300x.bandwidth_gbs, mi300x.tdp_w) == (1307.4, 192 * 2**30, 5300, 750)
    assert (gaudi2.bf16_tflops, gaudi2.memory_bytes, gaudi2.tdp_w) == (432, 96 * 2**30, 600)
    # MI250X: one entry per torch device (a GCD), half the package's figures
    assert catalog.resolve("mi250x").memory_bytes == 64 * 2**30 and catalog.resolve("mi250x").bf16_tflops == 191.5
    # relative to A100-80GB = 1.0: the MI300X below an H100 SXM, the CPU far below a GPU
    assert catalog.resolve("a100").speed_index < mi300x.speed_index < catalog.resolve("h100").speed_index
    assert cpu.speed_index < 0.1


def test_the_island_form_gives_every_device_its_island_and_the_bridge():
    c = parse_cluster_spec(SPEC)
    assert [d.island for d in c.devices] == ["nv", "nv", "amd", "amd"]
    assert [i.name for i in c.topology.islands] == ["nv", "amd"]
    assert c.topology.islands[1].backend == "nccl" and c.topology.islands[1].vendor == "amd"
    assert c.topology.islands[1].link.name == "xgmi" and c.topology.islands[1].link.bandwidth_gbs == pytest.approx(896 * 0.4)
    bridge = c.topology.bridge
    assert bridge.name == "host 25GbE" and bridge.bandwidth_gbs == pytest.approx(25 / 8 * 0.9)
    assert not c.topology.named and c.flat == "2xa100-80g,2xmi300x"
    # speeds are scaled over the whole cluster: the MI300X (1.9) runs at the thread's full pace
    assert c.devices[2].speed == 1.0 and c.devices[0].speed == pytest.approx(1 / 1.9)


def test_bridge_host_alone_is_the_cards_pcie():
    c = parse_cluster_spec("nv=a100-80g; gaudi=gaudi2; bridge=host")
    assert c.topology.bridge.bandwidth_gbs == 24.0 and "PCIe 4.0" in c.topology.bridge.source
    assert [d.island for d in c.devices] == ["nv", "gaudi"]


def test_a_cpu_item_in_a_flat_spec_is_an_island_of_its_own():
    c = parse_cluster_spec("2xa100-80g,cpu")
    assert [d.island for d in c.devices] == ["nvidia", "nvidia", "cpu"]
    assert c.topology.bridge.name == "host"
    one = parse_cluster_spec("a100-80g,rtx3090")   # today's one-island job is unchanged
    assert [d.island for d in one.devices] == ["", ""] and one.topology.bridge is None and not one.topology.islands


def test_describe_islands_names_devices_libraries_and_bridge():
    line = islands.describe_islands(parse_cluster_spec(SPEC))
    assert line.startswith("islands: nv = a100-80g#0,a100-80g#1 (nccl), amd = mi300x#2,mi300x#3 (rccl); "
                           "bridge host 25GbE")
    assert islands.describe_islands(parse_cluster_spec("a100-80g,rtx3090")) is None


@pytest.mark.parametrize("spec,what", [
    ("nv=2xa100-80g; amd=2xmi30x; bridge=host:25GbE", "unknown GPU 'mi30x' (did you mean: mi300x"),
    ("nv=2xa100-80g/nvlink; amd=2xmi300x/xgmi", "has 2 device islands (nv, amd) but no bridge"),
    ("nv=a100-80g,mi300x; bridge=host", "island 'nv' mixes device vendors (nvidia: a100-80g; amd: mi300x)"),
    ("a100-80g,gaudi2", "the cluster spec mixes device vendors (nvidia: a100-80g; gaudi: gaudi2)"),
    ("amd=2xmi300x/nvlink; bridge=host", "NVLink is NVIDIA's; these are amd devices (use xgmi)"),
    ("nv=a100-80g; net=25GbE; bridge=host", "net= joins nodes"),
    ("nv=a100-80g; bridge=host; bridge=10GbE", "bridge= is given twice"),
    ("nv=a100-80g; nv=2x3090; bridge=host", "named twice"),
])
def test_bad_island_specs_are_one_line_with_the_fix(spec, what):
    with pytest.raises(UsageError) as e:
        parse_cluster_spec(spec)
    assert what in e.value.what and e.value.fix and "\n" not in e.value.what


def test_the_nodes_form_is_unchanged():
    c = parse_cluster_spec("node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE")
    assert c.topology.named and c.topology.bridge is None and all(d.island == "" for d in c.devices)
    with pytest.raises(UsageError, match="2 nodes but no net=LINK"):
        parse_cluster_spec("node0=2xa100-80g; node1=4xrtx3090")


def test_job_islands_from_each_ranks_device():
    c = parse_cluster_spec(SPEC)
    found = job_islands([rank_device(spec_device=d) for d in c.devices], bridge=c.topology.bridge.name)
    assert found.describe() == "islands: nv = ranks 0,1 (nccl), amd = ranks 2,3 (rccl); bridge host 25GbE"
    assert found.leaders == (0, 2) and found.island_of(3).name == "amd" and found.multi
    # real devices: grouped by what each rank trains on, named by vendor
    real = job_islands([{"vendor": "nvidia", "device_type": "cuda", "backend": "nccl"},
                        {"vendor": "intel", "device_type": "hpu", "backend": "hccl"},
                        {"vendor": "nvidia", "device_type": "cuda", "backend": "nccl"}])
    assert [(i.name, i.ranks) for i in real.islands] == [("nvidia", (0, 2)), ("gaudi", (1,))]
    assert rank_device("cpu") == {"vendor": "cpu", "device_type": "cpu", "backend": "gloo", "island": ""}
    with pytest.raises(UsageError, match="island 'x' mixes device vendors"):
        job_islands([{"vendor": "nvidia", "device_type": "cuda", "backend": "nccl", "island": "x"},
                     {"vendor": "amd", "device_type": "cuda", "backend": "nccl", "island": "x"}], bridge="host")


CUDA = {"torch": "2.5.1", "torch_cuda": "12.4", "nccl": "2.21.5", "driver": "550.54", "cudnn": 90100}
ROCM = {"torch": "2.5.1", "torch_cuda": None, "nccl": "2.20.5", "driver": None, "cudnn": None}


def test_versions_may_differ_across_islands():
    # an NVIDIA node and an AMD node: CUDA and NCCL/RCCL differ by nature, only the bridge joins them
    assert check_node_versions([CUDA, CUDA, ROCM, ROCM], [0, 0, 1, 1], ["dgx", "mi"],
                               island_of=["nvidia", "nvidia", "amd", "amd"]) == []
    with pytest.raises(UsageError):       # the same job seen as one island is refused
        check_node_versions([CUDA, CUDA, ROCM, ROCM], [0, 0, 1, 1], ["dgx", "mi"])


def test_a_version_mismatch_inside_an_island_names_the_island():
    old_rocm = {**ROCM, "nccl": "2.18.3"}
    with pytest.raises(UsageError) as e:
        check_node_versions([CUDA, ROCM, old_rocm], [0, 1, 2], ["dgx", "mi-a", "mi-b"],
                            island_of=["nvidia", "amd", "amd"])
    assert e.value.what.startswith("in device island 'amd' (ranks 1,2): NCCL differs across nodes")
    assert "node 2 'mi-b'" in e.value.what and "2.20.5" in e.value.fix


def test_a_gaudi_machine_whose_torch_lacks_the_plugin_is_refused(tmp_path):
    driver = tmp_path / "drivers" / "habanalabs"
    driver.mkdir(parents=True)
    (tmp_path / "sys/class/accel/accel0/device").mkdir(parents=True)
    (tmp_path / "sys/class/accel/accel0/device/driver").symlink_to(driver)
    (tmp_path / "dev").mkdir()
    assert islands.present_accelerators(str(tmp_path)) == {"hpu": "/dev/accel/accel0 (habanalabs driver)"}
    with pytest.raises(UsageError) as e:
        islands.check_real_devices(str(tmp_path))
    assert "need habana_frameworks.torch" in e.value.what and "Gaudi" in e.value.fix
    islands.check_real_devices(str(tmp_path / "nothing"))      # no accelerator: nothing to say


def test_an_emulated_gaudi_gets_bf16_from_its_catalog_flag():
    """The precision rule reads compute capability; a non-NVIDIA device has none, so its flag
    stands in: an emulated Gaudi 2 trains in bf16, not fp16 with a GradScaler."""
    from hetrain.emulation.device import EmulatedDevice
    from hetrain.hardware.cluster import parse_cluster
    from hetrain.runtime.devices.precision_policy import device_facts

    for name, bf16 in (("gaudi2", True), ("mi300x", True), ("v100", False)):
        emulated = EmulatedDevice(parse_cluster(name)[0])
        assert emulated.spec.gpu == catalog.resolve(name)
        assert device_facts("cpu", given=emulated).real_bf16 is bf16, name


def test_emulated_nodes_of_different_vendors_join_as_islands():
    assert islands.join_node_items(["a100-80g:1.0", "rtx3090"]) == "a100-80g:1.0,rtx3090"
    assert islands.join_node_items(["a100-80g", "cpu"]) == "a100-80g,cpu"
    spec = islands.join_node_items(["a100-80g:1.0@1GiB", "a100-80g", "mi300x", "cpu"])
    assert spec == "nvidia=a100-80g:1.0@1GiB,a100-80g; amd=mi300x; cpu=cpu; bridge=host"
    assert [d.island for d in parse_cluster_spec(spec).devices] == ["nvidia", "nvidia", "amd", "cpu"]
    with pytest.raises(UsageError, match="not consecutive"):
        islands.join_node_items(["a100-80g", "mi300x", "a100-80g"])


def test_nodes_of_different_vendors_are_islands_bridged_by_the_network():
    c = parse_cluster_spec("dgx=2xa100-80g/nvlink; mi=2xmi300x/xgmi; net=100GbE")
    assert [d.island for d in c.devices] == ["nvidia", "nvidia", "amd", "amd"]
    assert c.topology.bridge is c.topology.net and c.topology.named
