"""The GPU a rank is to use is checked before torch.cuda.set_device (runtime/ranks/dist.py): one
line naming LOCAL_RANK, the GPUs this process sees, CUDA_VISIBLE_DEVICES and the fix, instead of
CUDA's 'invalid device ordinal'; and a GPU asked for where torch sees none."""

from __future__ import annotations

import pytest
import torch

from hetrain.errors import UsageError
from hetrain.runtime.ranks import dist as rank_dist


@pytest.fixture
def gpus(monkeypatch):
    """This process sees `n` GPUs (the CPU build here sees none); set_device must not be reached."""
    def see(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail(f"set_device({i}) reached"))
    return see


def test_a_local_rank_beyond_the_visible_gpus_is_one_line_with_the_fix(monkeypatch, gpus):
    """Slurm's --gpus-per-task gives each task one GPU (CUDA_VISIBLE_DEVICES=3) while torchrun
    numbers the node's processes LOCAL_RANK 0..3."""
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError) as e:
        rank_dist.init_distributed(timeout_s=5, use_cuda=True)
    what, fix = e.value.what, e.value.fix
    assert "LOCAL_RANK=2" in what and "sees 1 GPU" in what and "CUDA_VISIBLE_DEVICES='3'" in what, what
    assert "--nproc 1" in fix and "CUDA_VISIBLE_DEVICES" in fix, fix
    assert e.value.exit_code == 2 and "\n" not in what + fix


def test_a_local_rank_within_the_visible_gpus_is_used(monkeypatch, gpus):
    gpus(2)
    rank_dist.check_cuda_device(1)            # no error


def test_a_gpu_asked_for_where_torch_sees_none(monkeypatch, gpus):
    gpus(0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(UsageError) as e:
        rank_dist.check_cuda_device(0)
    assert "cuda:0" in e.value.what and "sees none" in e.value.what and torch.__version__ in e.value.what
    assert "CUDA_VISIBLE_DEVICES is unset" in e.value.what and "`hetrain run --help`" in e.value.fix


@pytest.mark.parametrize("visible, asked", [("0", True), ("GPU-5d3e", True), ("0,1", True), ("", False),
                                            ("-1", False), (None, False)])
def test_naming_gpus_in_cuda_visible_devices_asks_for_them(monkeypatch, visible, asked):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert rank_dist.cuda_asked_for() is asked
