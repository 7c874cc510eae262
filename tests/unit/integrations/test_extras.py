"""The extras stay optional: the base install imports none of their libraries, each extra in
pyproject.toml is the one `require` names, and a missing library is one line with the pip command."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hetrain.errors import UsageError
from hetrain.integrations import EXTRAS, require

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src"
HEAVY = sorted({m for mods in EXTRAS.values() for m in mods})


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_every_extra_in_pyproject_is_the_one_require_names():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert extra in declared, f"pyproject.toml has no [{extra}] extra"
        names = {req.split(">")[0].split("=")[0].split("[")[0].strip().lower() for req in declared[extra]}
        assert set(modules) <= names, (extra, modules, names)


def test_the_base_package_and_every_command_import_none_of_the_extras():
    r = _python("import sys, hetrain, hetrain.cli, hetrain.integrations\n"
                "from hetrain.cli import main\n"
                "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                f"print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "LOADED []", r.stdout[-2000:]


def test_a_missing_library_is_one_usage_error_naming_the_pip_command():
    with pytest.raises(UsageError) as e:
        require("hetrain_surely_not_installed", extra="sweep", feature="hetrain sweep")
    assert "hetrain sweep needs 'hetrain_surely_not_installed'" in e.value.what
    assert e.value.fix == 'pip install "hetrain[sweep]"'


@pytest.mark.parametrize("module, blocked, extra", [
    ("hetrain.integrations.lightning", "lightning", "lightning"),
    ("hetrain.integrations.transformers", "transformers", "hf"),
])
def test_an_integration_without_its_extra_names_the_extra(module, blocked, extra):
    # sys.modules[name] = None makes `import name` raise ImportError, as an absent package does
    r = _python(f"import sys\nsys.modules[{blocked!r}] = None\n"
                "from hetrain.errors import UsageError\n"
                f"try:\n    import {module}\nexcept UsageError as e:\n    print('FIX', e.fix)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f'FIX pip install "hetrain[{extra}]"', r.stdout + r.stderr


def test_hetrain_sweep_without_optuna_names_the_sweep_extra():
    r = _python("import sys\nsys.modules['optuna'] = None\nfrom hetrain.cli import main\n"
                "main(['sweep', 'x.py', '--trials', '1', '--emulate', 'a100-80g'])")
    assert r.returncode == 2, r.stderr
    assert 'fix: pip install "hetrain[sweep]"' in r.stderr and "Traceback" not in r.stderr
