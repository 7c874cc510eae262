"""benchmarks/chaos.py's machinery on one layout (a 2-stage pipeline) with 2 faults, a hang and an
out-of-memory error: the job survives both, uses every sample exactly once, and ends with the
parameters of an independent single-process run over the same batches."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from clirun import SRC
from hetrain.runtime.resilience.resume import read_sample_log

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(chaos, log: dict, steps: int) -> dict:
    """The same model, data and SGD in one process, one big batch per step, in the logged order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(chaos.DATASET, 16, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :4]).sum(1, keepdim=True)
    model = chaos.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        idx = torch.tensor([i for _, i in log[s]])
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_a_pipeline_survives_a_hang_and_an_oom_with_the_uninterrupted_parameters(tmp_path, monkeypatch):
    chaos = load_chaos()
    monkeypatch.setenv("PYTHONPATH", f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = argparse.Namespace(faults=2, steps=6, every=2, timeout=5.0, seed=0)
    faults = chaos.schedule(args.faults, args.steps, args.every, args.seed, "pp")
    assert sorted(f.split(":")[0] for f in faults) == ["oom", "stall"]
    _, out, ckpt, _, error = chaos.launch(tmp_path, "pp-chaos", args, "pp", faults)
    assert not error, error
    fired = (tmp_path / "pp-chaos-faults.jsonl").read_text().splitlines()
    assert len(fired) == 2                                   # both faults struck
    result = torch.load(out)
    assert result["restarts"] >= 1                           # the hang became an error and a restart
    assert chaos.samples_once(ckpt, args.steps)
    want = reference(chaos, read_sample_log(str(ckpt / "samples")), args.steps)
    got = result["params"]
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
