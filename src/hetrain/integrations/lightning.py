"""Lightning Fabric across mixed devices: change the import of Fabric, nothing else.

    from hetrain.integrations.lightning import Fabric, seed_everything   # was: from lightning.fabric import ...
    import hetrain.integrations.lightning as L                           # was: import lightning as L

    fabric = Fabric()                                    # HetrainStrategy, joined to hetrain's job: no launch()
    model, optimizer = fabric.setup(model, optimizer)    # any order with the data: hetrain.prepare
    loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)   # val: each rank its part
    for epoch in range(2):
        for batch in loader:                             # this rank's micro-batches of each global step
            optimizer.zero_grad()                        # a no-op inside the step: the gradient accumulates
            fabric.backward(loss_of(model, batch))       # weighted: the big-batch gradient
            fabric.clip_gradients(model, optimizer, clip_val=0.25)   # applied to the step's gradient
            optimizer.step()                             # the agreed global step, after the last one

Launch with `hetrain run train.py`. hetrain's settings go in
`Fabric(strategy=HetrainStrategy(global_batch=..., grad_clip=..., ...))`; Lightning's own Fabric
with that strategy works too, with fabric.launch(). Every other name of this module is Lightning's
(`L.seed_everything`, `L.LightningModule`, ...). The design, and what Fabric gives up under it, is
in fabric/strategy.py's docstring (with the drop-in Fabric and the checks of Fabric's accelerator
and devices); the loop, the step form that also redoes a forward's OOM (`for step in
fabric.strategy.steps()`), and clipping in fabric/loop.py's; the DataLoader rules, evaluation
loaders, the setup order and the global batch in fabric/data.py's.
"""

from __future__ import annotations

from . import require

require("lightning.fabric", extra="lightning", feature="hetrain.integrations.lightning")

# After the check: these import Lightning, whose absence would otherwise be a bare ImportError.
from .fabric.data import LoaderStep, StepLoader
from .fabric.loop import ForwardOutOfMemory, LoopStopped
from .fabric.strategy import Fabric, HetrainPrecision, HetrainStrategy

__all__ = ["Fabric", "ForwardOutOfMemory", "HetrainPrecision", "HetrainStrategy", "LoaderStep", "LoopStopped",
           "StepLoader"]


def __getattr__(name: str):
    """Lightning's own names (seed_everything, LightningModule, ...): the module stands in for
    `lightning` (and `lightning.fabric`) in a script's import line."""
    import lightning
    import lightning.fabric

    for home in (lightning, lightning.fabric):
        if hasattr(home, name):
            return getattr(home, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
