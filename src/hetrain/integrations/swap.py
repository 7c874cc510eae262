"""Zero-change mode: under `hetrain run`, a stock Trainer, TRL or Accelerate script runs on
hetrain's classes with no edit at all.

`hetrain run` puts a sitecustomize.py (SITE) on each worker's path; it calls install(), which adds
an import hook: as each library's module finishes loading, and before the script can take a name
from it, the stock class is put back as hetrain's:

    transformers.Trainer   -> hetrain's Trainer (hf/trainer.py); every class defined on it after
                              that (Seq2SeqTrainer, TRL's trainers, a framework's own subclass that
                              overrides compute_loss) inherits it, so its train() is hetrain's loop
    trl's SFT/DPO/Reward   -> the same, with what TRL needs on top (trl_parts/trainers.py: TrlLoop)
    accelerate.Accelerator -> hetrain's Accelerator (accel/accelerator.py); the Trainer's own
                              Accelerator inside transformers stays stock's (hetrain's Trainer runs
                              its own loop and makes its own job)

Rank 0 prints one line per library swapped. `hetrain run --no-swap` runs the stock classes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import os
import sys

# What `hetrain run` writes as the workers' sitecustomize.py (launch.py).
SITE = '''\
# Written by `hetrain run` (hetrain.integrations.swap): hetrain's classes in place of the stock ones.
from hetrain.integrations.swap import chain, install

install()
chain(__file__)
'''
SITE_NAME = "sitecustomize.py"
TRL_MODULES = {"trl.trainer.sft_trainer": "SFTTrainer", "trl.trainer.dpo_trainer": "DPOTrainer",
               "trl.trainer.reward_trainer": "RewardTrainer"}


def install() -> None:
    """The import hook, first on sys.meta_path; modules already loaded are swapped at once."""
    if any(isinstance(f, SwapFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SwapFinder())
    for name in AFTER:
        if name in sys.modules:
            AFTER[name](sys.modules[name])


def chain(here: str) -> None:
    """Run the sitecustomize this one hides (a later entry of sys.path), as Python would have."""
    folder = os.path.dirname(os.path.abspath(here))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != folder]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def say(library: str, stock: str, ours: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"hetrain: {stock} is hetrain's {ours} in this run (`hetrain run --no-swap` keeps the stock "
              f"{library} class)", file=sys.stderr, flush=True)


class SwapFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a watched module so the swap runs right after it loads."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in AFTER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = SwappingLoader(spec.loader, AFTER[fullname])
                return spec
        return None


class SwappingLoader(importlib.abc.Loader):
    def __init__(self, loader, after):
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name):          # get_source, is_package, ...: the real loader's
        return getattr(self.loader, name)


def swap_accelerate(module) -> None:
    from .accel.accelerator import Accelerator

    if getattr(module, "Accelerator", None) is not Accelerator:
        module.Accelerator = Accelerator
        say("Accelerate", "accelerate.Accelerator", "Accelerator")


PENDING: list = []       # transformers.trainer modules loaded while hetrain's Trainer was being defined


def trainer_defined(module=None) -> None:
    """hf/trainer.py has loaded, hetrain's Trainer with it: the swap that had to wait for it runs now."""
    while PENDING:
        swap_trainer(PENDING.pop())


def swap_trainer(module) -> None:
    """transformers.trainer loaded: its Trainer becomes hetrain's, and its own Accelerator stays stock's."""
    import accelerate.accelerator
    import transformers

    ours = sys.modules.get("hetrain.integrations.hf.trainer")
    if ours is not None and not hasattr(ours, "Trainer"):
        # A script imported hetrain's Trainer itself, whose class statement loaded this module:
        # the class does not exist yet, so the swap waits for it (trainer_defined, once hf/trainer.py has loaded)
        PENDING.append(module)
        return
    from .hf.trainer import Trainer
    from .trl_parts.trainers import refuse_loop_overrides

    if getattr(module, "Trainer", None) is None or issubclass(module.Trainer, Trainer):
        return
    stock = module.Trainer

    def __init__(self, *args, **kwargs):
        refuse_loop_overrides(type(self))      # a framework's subclass that hetrain's loop would bypass
        Trainer.__init__(self, *args, **kwargs)

    __init__.__signature__ = inspect.signature(stock.__init__)
    swapped = type("Trainer", (Trainer,), {"__init__": __init__, "__module__": __name__, "__doc__": Trainer.__doc__})
    module.Accelerator = accelerate.accelerator.Accelerator
    module.Trainer = swapped
    transformers.Trainer = swapped
    say("transformers", "transformers.Trainer", "Trainer (and every Trainer subclass defined after it)")


def swap_trl(module) -> None:
    from .trl_parts.trainers import TrlSwap

    name = TRL_MODULES[module.__name__]
    cls = getattr(module, name, None)
    if cls is None or issubclass(cls, TrlSwap):
        return
    setattr(module, name, type(name, (TrlSwap, cls), {"__module__": cls.__module__, "__qualname__": name}))


AFTER = {"accelerate": swap_accelerate, "transformers.trainer": swap_trainer,
         "hetrain.integrations.hf.trainer": trainer_defined,
         **{name: swap_trl for name in TRL_MODULES}}
