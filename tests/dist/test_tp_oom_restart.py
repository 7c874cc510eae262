"""An out-of-memory error under tensor parallelism split by speed ends the attempt on both ranks,
and `hetrain run --max-restarts` resumes from the last checkpoint with that micro-batch halved:
the job ends with the parameters of an uninterrupted run and every sample once. Real gloo ranks
under torchrun, through benchmarks/chaos.py's own job (a float64 Hugging Face GPT-2) and
comparison, at the smallest size of its TP run that read "differ" (one OOM, 4 steps): the halved
micro-batches sum each gradient in another order, which moves GPT-2's key biases (zero gradient in
exact arithmetic, float64 rounding alone) by ~100% of themselves and every other tensor by ~1e-16.
"""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos_bench_tp", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_an_oom_under_tp_by_speed_resumes_halved_to_the_uninterrupted_parameters(tmp_path):
    pytest.importorskip("transformers")
    chaos = load_chaos()
    args = SimpleNamespace(steps=4, every=2, timeout=30)
    oom = "oom:rank=1,step=3,micro=0,phase=backward,attempt=0"
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(chaos.launch, tmp_path, name, args, "tp", faults)
                for name, faults in (("clean", None), ("oom", [oom]))]
        (_, clean_out, _, _, clean_error), (_, out, ckpt, stdout, error) = (r.result() for r in runs)
    assert not clean_error and not error, (clean_error, error)
    assert "micro-batch 32 -> 16" in stdout and "resumed from step-00000002" in stdout and torch.load(out)["restarts"] == 1, stdout[-2000:]
    a, b = torch.load(out)["params"], torch.load(clean_out)["params"]
    equal, _, worst, name = chaos.compare(a, b)
    assert equal, (worst, name)
    # the tensors that are not within rounding of the uninterrupted run's hold rounding alone
    largest = max(t.abs().max().item() for t in b.values())
    apart = [k for k in b if (a[k] - b[k]).abs().max().item() > 1e-12 * b[k].abs().max().item()]
    assert all(b[k].abs().max().item() < 1e-12 * largest for k in apart), apart
    assert chaos.samples_once(ckpt, args.steps)
