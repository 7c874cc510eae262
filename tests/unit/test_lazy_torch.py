"""Planning needs no torch: `import hetrain` and `hetrain simulate` / `hetrain plan --model` (catalog
estimates) run without importing it (seconds saved on every call); the engine's names still load
on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_import_and_catalog_planning_do_not_import_torch():
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "hetrain" in r.stdout                       # the commands ran and printed their plans
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH", r.stdout[-2000:]


def test_the_engine_names_still_load_from_the_package():
    import hetrain
    from hetrain.runtime import engine

    assert hetrain.init is engine.init and hetrain.Engine is engine.Engine
    from hetrain import Engine, init       # noqa: F401  (the import form users write)
    assert set(hetrain.__all__) <= set(dir(hetrain))
    try:
        hetrain.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
