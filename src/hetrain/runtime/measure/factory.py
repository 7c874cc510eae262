"""A model factory named on the command line (`hetrain plan --model-factory`): 'pkg.module:function'
or 'path/to/script.py:function', returning (model, optimizer, dataset[, collate_fn]) as they
would be passed to ht.prepare. Loaded by the CLI (to fail before any process starts) and by each
of `hetrain plan`'s and `hetrain bench`'s workers (cli/plan_worker.py, benching/worker.py)."""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import sys
from pathlib import Path

from ...errors import UsageError


def load_factory(spec: str):
    """'pkg.module:function' or 'path/to/script.py:function' -> the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise UsageError(f"--model-factory {spec!r} is not MODULE:FUNCTION or SCRIPT.py:FUNCTION",
                         "e.g. --model-factory train.py:make or --model-factory mypkg.models:make")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UsageError(f"--model-factory: {target!r} does not exist", "check the path to your script")
            sys.path.insert(0, str(path.resolve().parent))
            mod_spec = importlib.util.spec_from_file_location(f"_hetrain_factory_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)     # `if __name__ == "__main__":` keeps training out
        elif target.startswith(".") or not all(part.isidentifier() for part in target.split(".")):
            raise ImportError("not a module name")       # import_module would raise a TypeError
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise UsageError(f"--model-factory: cannot import {target!r}: {e}",
                         "check the module name and PYTHONPATH, or give a script path") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = defined_functions(module)
        has = f"it defines {', '.join(found)}" if found else "it defines no function"
        raise UsageError(f"--model-factory: {target!r} has no function {name!r} ({has})",
                         (f"name one of them, e.g. --model-factory {target}:{found[0]}, or define " if found
                          else "define ") + f"{name}(): return model, optimizer, dataset")
    return fn


def defined_functions(module) -> list[str]:
    """The public functions `module` itself defines (not those it imports), for naming them."""
    return sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                  and v.__module__ == module.__name__)


def absolute(spec: str) -> str:
    """The spec with a script's path made absolute, so a worker started elsewhere finds it."""
    target, sep, name = spec.rpartition(":")
    return f"{Path(target).resolve()}{sep}{name}" if target.endswith(".py") else spec


def call_factory(fn, spec: str):
    """fn() checked: (model, optimizer, dataset, collate_fn or None)."""
    import torch

    made = fn()
    if not isinstance(made, (tuple, list)) or len(made) not in (3, 4):
        raise UsageError(f"--model-factory {spec!r} returned {type(made).__name__}",
                         "return (model, optimizer, dataset) or (model, optimizer, dataset, collate_fn)")
    model, opt, dataset = made[:3]
    if not isinstance(model, torch.nn.Module) or not isinstance(opt, torch.optim.Optimizer):
        raise UsageError(f"--model-factory {spec!r}: expected (nn.Module, Optimizer, dataset, …), got "
                         f"({type(model).__name__}, {type(opt).__name__}, …)",
                         "return (model, optimizer, dataset) as you would pass them to ht.prepare")
    if not hasattr(dataset, "__len__") or len(dataset) < 1:
        raise UsageError(f"--model-factory {spec!r}: the dataset is empty or has no length",
                         "return a map-style dataset with at least one sample")
    collate = made[3] if len(made) == 4 else None
    return model, opt, dataset, collate
