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
from .planning.plan import DevicePlan, Plan
from .runtime.config import Config
from .runtime.engine import Engine, init

__version__ = "0.1.0"
__all__ = ["init", "Engine", "Config", "Plan", "DevicePlan", "HetrainError", "UsageError", "__version__"]
