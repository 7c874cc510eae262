"""Planning needs no torch: `import hetrain` and `hetrain simulate` / `hetrain plan --model` (catalog
estimates) run without importing it (seconds saved on every call); the engine's names still load
on first use. A data-parallel job that never checkpoints does not import torch's checkpoint or
pipelining packages (0.3-0.6 s of every rank's start-up on a 2-core AVX2 host, of a 7-8 s start
that is mostly torch's own import and the dynamo import its first optimizer makes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

_SCRIPT = """
import sys
import hetrain, hetrain.cli
from hetrain import Config, Plan, UsageError
from hetrain.cli import main
spec = "node0=2xa100-80g/nvlink; node1=2xrtx3090,t4/pcie4; net=25GbE"
for argv in (["simulate", "--cluster", spec, "--model", "gpt2-350m", "--global-batch", "64"],
             ["plan", "--emulate", spec, "--model", "gpt2-350m", "--global-batch", "64", "--json"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), (argv, e.code)
print("TORCH-LOADED" if "torch" in sys.modules else "NO-TORCH")
"""


@pytest.fixture(scope="module")
def one_process():
    """_SCRIPT, then _JOB, in one fresh interpreter (one start and import of hetrain for both)."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT + _JOB], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()       # the planning's output ends at _SCRIPT's verdict line
    cut = next((k + 1 for k, line in enumerate(lines) if line in ("NO-TORCH", "TORCH-LOADED")), len(lines))
    return "\n".join(lines[:cut]), "\n".join(lines[cut:])


def test_import_and_catalog_planning_do_not_import_torch(one_process):
    planning, _ = one_process
    assert "hetrain" in planning                       # the commands ran and printed their plans
    assert planning.strip().splitlines()[-1] == "NO-TORCH", planning[-2000:]


def test_the_engine_names_still_load_from_the_package():
    import hetrain
    from hetrain.runtime import engine

    assert hetrain.init is engine.init and hetrain.Engine is engine.Engine
    from hetrain import Engine, init       # noqa: F401  (the import form users write)
    assert set(hetrain.__all__) <= set(dir(hetrain))
    try:
        hetrain.no_such_name  # noqa: B018 (the attribute access is the test)
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


_JOB = """
import sys
import torch
import hetrain
import hetrain.emulation
ht = hetrain.init(global_batch=8, max_steps=2, reporting=hetrain.Reporting(verbose=False),
                  emulation=hetrain.emulation.Emulation(cluster="a100-80g"))   # the memory meter too
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
model = torch.nn.Linear(4, 1)
model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
for step in batches:
    for mb in step:
        with mb:
            x, y = mb.batch
            ht.backward(torch.nn.functional.mse_loss(model(x), y))
    ht.step()
ht.close()
heavy = ("torch.distributed.checkpoint", "torch.distributed.pipelining")   # (DTensor: torch's optimizer loads it)
print("LOADED", [m for m in heavy if m in sys.modules])
"""


def test_a_data_parallel_job_without_checkpoints_leaves_checkpoint_and_pipelining_unloaded(one_process):
    _, job = one_process
    assert job.strip().splitlines()[-1] == "LOADED []", job[-2000:]
