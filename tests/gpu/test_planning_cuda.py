"""The profiler and `hetrain plan` on real GPUs: activation memory from max_memory_allocated, wall
time with synchronisation, the optimizer twin on the device, the cache. Skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from hetrain.planning.plan import Plan
from hetrain.runtime.measure.profiler import measure, profile_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the profiler's CUDA path")]

D_IN, D_HIDDEN = 256, 1024
SRC = Path(__file__).resolve().parents[2] / "src"


def mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.ReLU(), nn.Linear(D_HIDDEN, 16)).to(device)


def test_profiles_a_model_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path))
    dev = torch.device("cuda", 0)
    model = mlp(dev)
    opt = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]

    def load(m):
        return torch.randn(m, D_IN, device=dev), torch.randn(m, 16, device=dev)

    cap = torch.cuda.get_device_properties(dev).total_memory
    p = measure(model, opt, load, device=dev, label="cuda:0", memory_bytes=cap, max_size=64)
    # The allocator rounds blocks up, so at least the saved input and ReLU output per sample.
    assert p.activation_bytes_per_sample >= (D_IN + D_HIDDEN) * 4 * 0.9
    assert p.fixed_bytes == 16 * sum(q.numel() for q in model.parameters())
    assert p.per_sample_s > 0 and p.sizes[-1] == 64 and p.memory_bytes == cap
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(q.grad is None for q in model.parameters())
    first, hit = profile_device(model, opt, load, device=dev, label="cuda:0", memory_bytes=cap, max_size=64)
    again, hit2 = profile_device(model, opt, load, device=dev, label="cuda:0", memory_bytes=cap, max_size=64)
    assert not hit and hit2 and again == first


def hetrain(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "hetrain", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_hetrain_plan_measures_every_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HETRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "factory.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
            data = torch.utils.data.TensorDataset(torch.randn(512, 64), torch.randn(512, 4))
            return model, torch.optim.AdamW(model.parameters()), data
    """))
    n = torch.cuda.device_count()
    r = hetrain("plan", "--model-factory", f"{tmp_path / 'factory.py'}:make", "--global-batch", str(32 * n),
                "--out", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.world_size == n and all(d.device.startswith(f"cuda:{d.rank}") for d in plan.devices)
    assert plan.predicted["samples_per_s"] > 0
