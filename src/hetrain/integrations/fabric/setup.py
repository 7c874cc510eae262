"""fabric.setup / setup_module / setup_optimizers / setup_dataloaders under HetrainStrategy, in any
order: each hands its piece over, and hetrain.prepare runs once it has the model, the optimizer
and the training data (it measures the model on the data to plan every device's share), at the
call that brought the last of them (a collective: every rank makes the same calls in the same
order).

The global batch. Stock Fabric on W equal devices steps over `batch_size x W` samples, the
DataLoader's batch_size on every rank. hetrain keeps that number (so a learning rate means what it
meant) and splits it unevenly: the DataLoader's batch_size is read as the MEAN share of a device,
as the Trainer integration reads per_device_train_batch_size. HetrainStrategy(global_batch=N)
names it directly and must then agree with batch_size x W, unless the DataLoader kept its default
batch_size of 1 (nothing said).
"""

from __future__ import annotations


from ...errors import UsageError
from ...runtime.loop.stream import stream_length
from .data import TrainingData
from .wrappers import FabricModel, FabricOptimizer, FabricScheduler


def global_batch(given: int | None, data: TrainingData, world_size: int) -> int:
    """The job's global batch from HetrainStrategy(global_batch=) and the DataLoader's batch_size."""
    implied = data.batch_size * world_size
    if given is None:
        return implied
    if data.batch_size != 1 and given != implied:
        raise UsageError(f"HetrainStrategy(global_batch={given}) but the training DataLoader's batch_size="
                         f"{data.batch_size} on {world_size} devices is {implied} samples per step (batch_size is "
                         "read as the mean share of a device)",
                         f"drop global_batch= from HetrainStrategy, or use DataLoader(batch_size={given // world_size})"
                         if given % world_size == 0 else
                         "drop global_batch= from HetrainStrategy, or drop batch_size= from the DataLoader")
    return given


class Pieces:
    """What the setup calls have handed over, and what hetrain.prepare made of them."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.module = self.optimizer = self.scheduler = None    # the user's own
        self.data: TrainingData | None = None
        self.steps = None                  # hetrain's Steps, once prepared

    def take_both(self, module, optimizer, scheduler=None):
        """fabric.setup(model, optimizer[, scheduler=]): both in before prepare may run. Returns
        what Fabric wraps: the model, the optimizer, the scheduler (None when none was given)."""
        self.check_new(module=module, optimizer=optimizer)
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.prepare_when_ready()
        return (FabricModel(module, self.strategy), FabricOptimizer(optimizer, self.strategy),
                FabricScheduler(scheduler, self.strategy) if scheduler is not None else None)

    def take_module(self, module) -> FabricModel:
        self.check_new(module=module)
        self.module = module
        self.prepare_when_ready()
        return FabricModel(module, self.strategy)

    def take_optimizer(self, optimizer) -> FabricOptimizer:
        self.check_new(optimizer=optimizer)
        self.optimizer = optimizer
        self.prepare_when_ready()
        return FabricOptimizer(optimizer, self.strategy)

    def check_new(self, *, module=None, optimizer=None) -> None:
        if module is not None and self.module is not None:
            raise UsageError("a second model set up under HetrainStrategy (fabric.setup or setup_module called twice)",
                             "set up one model and one optimizer per job")
        if optimizer is not None and self.optimizer is not None:
            raise UsageError("a second optimizer set up under HetrainStrategy", "set up exactly one optimizer")

    def take_data(self, data: TrainingData) -> None:
        if stream_length(data.dataset) is None and self.strategy.joined().config.max_steps is None:
            raise UsageError(f"HetrainStrategy's training DataLoader reads an IterableDataset without a length "
                             f"({type(data.dataset).__name__}): its passes' steps cannot be counted",
                             "pass HetrainStrategy(max_steps=N) (or give the dataset a __len__)")
        global_batch(self.strategy.given_global_batch, data, self.strategy.joined().world_size)   # refused here
        self.data = data
        self.prepare_when_ready()

    def missing(self) -> list[str]:
        """The setup calls hetrain still waits for."""
        calls = [] if self.data is not None else ["fabric.setup_dataloaders(train_loader)"]
        if self.module is None and self.optimizer is None:
            return [*calls, "fabric.setup(model, optimizer)"]
        return calls + (["fabric.setup_module(model)"] if self.module is None else []) + (
            ["fabric.setup_optimizers(optimizer)"] if self.optimizer is None else [])

    def ready_steps(self):
        """hetrain's Steps, or one UsageError naming the setup call still missing."""
        if self.steps is None:
            raise UsageError("the training loader was iterated before " + " and ".join(self.missing()),
                             "set up the model, its optimizer and the training DataLoader first, in any order")
        return self.steps

    def prepare_when_ready(self) -> None:
        if self.steps is not None or self.missing():
            return
        strategy, module, optimizer = self.strategy, self.module, self.optimizer
        engine = strategy.joined()
        # The DataLoader's word for these (as for Fabric's own sampler), and the global batch rule above.
        engine.configure(shuffle=self.data.shuffle, drop_last=self.data.drop_last,
                         global_batch=global_batch(strategy.given_global_batch, self.data, engine.world_size))
        model, prepared, self.steps = engine.prepare(module, optimizer, self.data.dataset,
                                                     collate_fn=self.data.collate_fn, forward=strategy.forward,
                                                     parallel=strategy.layout)                  # (collective)
        if self.scheduler is None:
            return
        if getattr(self.scheduler, "optimizer", None) is not prepared:
            raise UsageError("the LR scheduler's optimizer is not the one hetrain trains with (its sharding replaced "
                             "the optimizer)",
                             "build the scheduler on the optimizer fabric.setup(model, optimizer) returns, after "
                             "fabric.setup_dataloaders, then fabric.strategy.engine.register_state('lr_scheduler', "
                             "scheduler)")
        engine.register_state("lr_scheduler", self.scheduler)   # checkpointed with the job, restored on resume
