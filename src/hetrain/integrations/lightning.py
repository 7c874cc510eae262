"""Lightning Fabric across mixed devices: `Fabric(strategy=HetrainStrategy(global_batch=N))`.

    from lightning.fabric import Fabric
    from hetrain.integrations.lightning import HetrainStrategy

    fabric = Fabric(strategy=HetrainStrategy(global_batch=64))   # the one changed line
    fabric.launch()                                      # joins hetrain's job (hetrain.init)
    model, optimizer = fabric.setup(model, optimizer)    # any order with the data: hetrain.prepare
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=32, shuffle=True))
    for epoch in range(2):
        for batch in loader:                             # this rank's micro-batches of each global step
            optimizer.zero_grad()                        # a no-op inside the step: the gradient accumulates
            fabric.backward(loss_of(model, batch))       # weighted: the big-batch gradient
            optimizer.step()                             # the agreed global step, after the last one
    fabric.strategy.close()

Launch with `hetrain run [--emulate a100-80g,rtx3090] train.py`. The design, and what Fabric gives
up under it, is in fabric/strategy.py's docstring; the loop, and the step form that also redoes a
forward's OOM (`for step in fabric.strategy.steps()`), in fabric/loop.py's; the setup order and the
global batch in fabric/setup.py's; the DataLoader rules in fabric/data.py's.
"""

from __future__ import annotations

from . import require

require("lightning.fabric", extra="lightning", feature="hetrain.integrations.lightning")

# After the check: these import Lightning, whose absence would otherwise be a bare ImportError.
from .fabric.data import LoaderStep, StepLoader
from .fabric.loop import ForwardOutOfMemory, LoopStopped
from .fabric.strategy import HetrainPrecision, HetrainStrategy

__all__ = ["ForwardOutOfMemory", "HetrainPrecision", "HetrainStrategy", "LoaderStep", "LoopStopped", "StepLoader"]
