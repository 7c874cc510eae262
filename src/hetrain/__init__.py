"""hetrain: train one PyTorch model across mixed GPUs at close to the sum of their speeds.

    import hetrain
    ht = hetrain.init(global_batch=256)
    model, opt, batches = ht.prepare(model, opt, dataset)
    for step in batches:
        for mb in step:
            with mb:
                x, y = mb.batch
                with ht.autocast():
                    loss = F.cross_entropy(model(x), y)
                ht.backward(loss)
        ht.step()
    ht.close()
"""

from .errors import HetrainError, UsageError
from .layout_spec import DataParallel, Pipeline, TensorParallel
from .planning.plan import DevicePlan, Plan
from .runtime.config import Config
from .runtime.config_groups import Checkpoints, Compression, Memory, Rebalancing, Reporting
from .runtime.resilience.worker_errors import install_import_hook
from .version import __version__

install_import_hook()    # a bad value in a group made before init() is one line, as init()'s own are

# The launcher's and the tests' settings group is not exported here: a script never sets it.
__all__ = ["init", "Engine", "Config", "Checkpoints", "Rebalancing", "Compression", "Memory", "Reporting",
           "Plan", "DevicePlan", "DataParallel", "TensorParallel", "Pipeline",
           "HetrainError", "UsageError", "__version__"]

# The engine imports torch (seconds): loaded on first use, so that planning and `hetrain simulate`
# run without it.
_LAZY = ("init", "Engine")


def __getattr__(name: str):
    if name in _LAZY:
        from .runtime import engine

        value = getattr(engine, name)
        globals()[name] = value
        return value
    if name == "sweep":          # hetrain.sweep: the running sweep trial's device (sweeping/session.py)
        from .sweeping import session

        globals()[name] = session
        return session
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
