"""`from hetrain.integrations.lightning import Fabric`: the one line a stock Fabric script changes.

Lightning's Fabric with HetrainStrategy as its strategy, joined to the job at construction, as
`fabric run` joins Fabric's own processes: a script written for `fabric run` (no fabric.launch())
runs under `hetrain run` unchanged; fabric.launch() is then a no-op. Under --emulate its
accelerator 'auto' is the CPU the emulated devices run on. Every other argument is Fabric's.
"""

from __future__ import annotations

from lightning.fabric import Fabric as LightningFabric

from ...errors import UsageError
from .strategy import HetrainStrategy


class Fabric(LightningFabric):
    """Fabric(...) as Lightning's, on hetrain's job. `strategy=HetrainStrategy(...)` passes
    hetrain's settings (global_batch, precision, grad_clip, memory, ...); 'auto' and 'ddp' are
    HetrainStrategy() (DDP with uneven shares)."""

    def __init__(self, *, strategy="auto", accelerator="auto", **kwargs):
        if isinstance(strategy, str) and strategy in ("auto", "ddp"):
            strategy = HetrainStrategy()
        elif not isinstance(strategy, HetrainStrategy):
            raise UsageError(f"Fabric(strategy={strategy!r}) from hetrain.integrations.lightning: it runs hetrain's "
                             "strategy, DDP with uneven shares across the job's devices",
                             "drop strategy=, or pass strategy=HetrainStrategy(...) for hetrain's settings")
        if accelerator == "auto" and strategy.emulates():
            accelerator = "cpu"
        super().__init__(strategy=strategy, accelerator=accelerator, **kwargs)
        if not self._launched:
            self._strategy.setup_environment()     # joins hetrain's job (collective), as Fabric's CLI does
            self._launched = True
