"""Lightning Fabric across mixed devices: `Fabric(strategy=HetrainStrategy(global_batch=N))`.

    from lightning.fabric import Fabric
    from hetrain.integrations.lightning import HetrainStrategy

    fabric = Fabric(strategy=HetrainStrategy(global_batch=64, max_steps=100))
    fabric.launch()                                      # joins hetrain's job (hetrain.init)
    loader = fabric.setup_dataloaders(DataLoader(dataset, shuffle=True))   # the data first
    model, optimizer = fabric.setup(model, optimizer)    # hetrain.prepare: plan, wrap, resume
    for step in loader:                                  # one optimizer step over the global batch
        for mb in step:                                  # this rank's share, in micro-batches
            with mb:                                     # an OOM here: agreed, halved, redone
                fabric.backward(model(**mb.batch).loss)  # weighted: the big-batch gradient
        optimizer.step()                                 # hetrain's step; step.loss is the global loss
    fabric.strategy.close()

Launch with `hetrain run [--emulate a100-80g,rtx3090] train.py`. The design, and what Fabric gives
up under it, is in fabric/strategy.py's docstring; the DataLoader rules in fabric/data.py's.
"""

from __future__ import annotations

from . import require

require("lightning.fabric", extra="lightning", feature="hetrain.integrations.lightning")

# After the check: these import Lightning, whose absence would otherwise be a bare ImportError.
from .fabric.data import LoaderStep, StepLoader
from .fabric.strategy import HetrainPrecision, HetrainStrategy

__all__ = ["HetrainPrecision", "HetrainStrategy", "LoaderStep", "StepLoader"]
