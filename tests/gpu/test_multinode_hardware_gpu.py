"""The multi-node hardware pieces on real GPUs: versions_here's CUDA/NCCL/driver path agrees with
the full machine query, and NCCL connects with the link settings nccl_link_fixes chooses.
Skipped without CUDA (and the NCCL run without two GPUs: NCCL needs one GPU per rank)."""

import pytest
import torch

from harness import run_ranks
from hetrain.hardware import driver, ranks
from hetrain.hardware.network import link_facts_here, nccl_link_fixes
from hetrain.hardware.node_versions import MACHINE_ENV, check_node_versions, versions_here

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: NCCL and driver versions")]


def test_versions_here_on_cuda_matches_the_full_query(monkeypatch):
    monkeypatch.delenv(MACHINE_ENV, raising=False)
    here = versions_here()
    full = ranks.rank_versions(driver.query_machine_in_subprocess())
    assert here["nccl"] == ".".join(str(x) for x in torch.cuda.nccl.version())
    assert {k: here[k] for k in ranks.FIELDS} == {k: full[k] for k in ranks.FIELDS}
    assert here["driver"], "NVML must give the driver on a CUDA machine"
    assert here["gpus"] == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert check_node_versions([here, here], [0, 1], ["a", "b"]) == []


def _all_reduce(rank, world):
    import datetime

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
    x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    dist.barrier()
    dist.destroy_process_group()
    return x.cpu().tolist()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA: 2 GPUs for a 2-rank NCCL group")
def test_nccl_connects_with_the_chosen_link_settings():
    fixes = nccl_link_fixes(link_facts_here(), endpoint_host="127.0.0.1", environ={})
    env = {f.var: f.value for f in fixes}
    assert env["NCCL_SOCKET_IFNAME"] == "=lo"
    out = run_ranks(_all_reduce, 2, timeout=120, env=env)
    assert out == [[3.0] * 4, [3.0] * 4]
