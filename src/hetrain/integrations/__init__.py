"""hetrain inside the tools users already run: the Hugging Face Trainer (`transformers`), Lightning
Fabric (`lightning`). Each lives in its own module and imports its library only when that module
is imported, so `import hetrain` stays light; a missing library is one error naming the extra.

    from hetrain.integrations.transformers import Trainer      # pip install "hetrain[hf]"
    from hetrain.integrations.lightning import HetrainStrategy # pip install "hetrain[lightning]"
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import UsageError

# extra -> what it installs, as pyproject.toml's [project.optional-dependencies] names it
EXTRAS = {
    "hf": ("transformers", "accelerate", "peft", "trl"),
    "lightning": ("lightning",),
    "sweep": ("optuna",),
    "tensorboard": ("tensorboard",),
}


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise one UsageError naming the exact pip command for `extra`.
    `feature` says what needed it ("hetrain.integrations.transformers", "hetrain sweep")."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}")   # a programming error, not the user's
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UsageError(f"{feature} needs {module!r}, which is not installed ({e})",
                         f'pip install "hetrain[{extra}]"') from None
