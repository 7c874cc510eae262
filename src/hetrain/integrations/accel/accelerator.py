"""hetrain's Accelerator: an Accelerate script's verbs, on hetrain's engine.

Why not a subclass of accelerate.Accelerator: constructing one joins Accelerate's own process group,
and every verb it adds assumes equal batches on every rank (its samplers, its gradient accumulation
counted in batches, its gathers). This class keeps the verbs a training script uses and runs them
on hetrain.init / ht.prepare (the global batch split unevenly, the big-batch weighting, one agreed
step, exact checkpoints); anything else of Accelerate's is refused in one line naming the fix.

The global batch is stock Accelerate's on this many equal GPUs: the training DataLoader's
batch_size x gradient_accumulation_steps x processes (split_batches=True: batch_size x
gradient_accumulation_steps), as hetrain's Trainer does; batch_size is then the mean share.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from ...errors import UsageError
from ...runtime.config import integration_layout
from ...runtime.engine import init
from ...runtime.loop.stream import is_stream, stream_length
from ...runtime.ranks.dist import env_rank
from ...runtime.resilience import resume as persist
from ...runtime.resilience.store import Checkpointer, model_signature
from ...runtime.resilience.worker_errors import install_excepthook
from ...runtime.user_objects import to_device
from . import evaluation
from .loop import Run, StepOptimizer, StepScheduler, TrainLoader

# Accelerator(...) keywords hetrain honours, and the values of the rest it accepts (their defaults)
PRECISIONS = {"no": "fp32", None: "fp32", "bf16": "bf16", "fp16": "fp16"}
DEFAULTS = {"device_placement": True, "step_scheduler_with_optimizer": True, "log_with": None, "cpu": False,
            "project_dir": None, "rng_types": None, "even_batches": True}
FIX = ("use hetrain's own: Accelerator(hetrain={'sharding': 'fsdp' | 'zero1' | 'capacity'}) to shard, "
       "hetrain={'precision': 'auto'} for each device's precision, or the stock Accelerator for this script")


class Accelerator:
    """`from hetrain.integrations.accelerate import Accelerator`: an Accelerate script across mixed
    devices. `hetrain={...}` passes hetrain.init's keywords (precision='auto', sharding, emulate,
    max_steps or epochs to cap the run, seed, ...). Launch with `hetrain run [--emulate ...]`."""

    def __init__(self, *, gradient_accumulation_steps: int = 1, mixed_precision: str | None = None,
                 split_batches: bool = False, hetrain: dict | None = None, **accelerate_kwargs):
        install_excepthook(*env_rank(), lambda: None)          # from here on, bad input is one line
        for name, value in accelerate_kwargs.items():
            if name not in DEFAULTS:
                raise UsageError(f"Accelerator({name}=...): not part of hetrain's Accelerator (its plugins and "
                                 "kwargs handlers build Accelerate's own distributed setup)", f"remove {name}=; {FIX}")
            if name not in ("cpu", "project_dir") and value != DEFAULTS[name]:
                raise UsageError(f"Accelerator({name}={value!r}): hetrain's Accelerator keeps {DEFAULTS[name]!r}",
                                 f"remove {name}=")
        if mixed_precision not in PRECISIONS:
            raise UsageError(f"Accelerator(mixed_precision={mixed_precision!r}): hetrain runs 'no', 'bf16' or 'fp16'",
                             "use one of those, or hetrain={'precision': 'auto'} (each device its own)")
        if not (isinstance(gradient_accumulation_steps, int) and gradient_accumulation_steps >= 1):
            raise UsageError(f"Accelerator(gradient_accumulation_steps={gradient_accumulation_steps!r})",
                             "use a whole number >= 1")
        self.hetrain = dict(hetrain or {})
        self.hetrain.setdefault("precision", PRECISIONS[mixed_precision])
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.split_batches = split_batches
        self.engine = None               # hetrain's job, from prepare()
        self.run: Run | None = None
        self.model = None
        self.current_eval = None         # the evaluation loader being iterated (gather_for_metrics)

    # -- the processes ------------------------------------------------------------------------
    process_index = property(lambda self: self.engine.rank if self.engine else env_rank()[0])
    num_processes = property(lambda self: self.engine.world_size if self.engine else env_rank()[1])
    local_process_index = property(lambda self: int(os.environ.get("LOCAL_RANK", "0")))
    is_main_process = property(lambda self: self.process_index == 0)
    is_local_main_process = property(lambda self: self.local_process_index == 0)
    sync_gradients = property(lambda self: self.run is None or self.run.sync_gradients,
                              doc="True on this rank's last micro-batch of a step (and outside the loop)")

    @property
    def device(self) -> torch.device:
        if self.engine is not None:
            return self.engine.device
        return torch.device("cpu")       # hetrain moves the model to its device in prepare()

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    # -- prepare --------------------------------------------------------------------------------
    def prepare(self, *objects):
        """model, optimizer, the training DataLoader (the first one), evaluation DataLoaders and LR
        schedulers, in any order, in one call; returned in the same order."""
        if self.engine is not None:
            raise UsageError("accelerator.prepare was called twice under hetrain",
                             "prepare the model, optimizer, dataloaders and scheduler in one call")
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        loaders = [o for o in objects if isinstance(o, DataLoader)]
        schedulers = [o for o in objects if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
        if len(models) != 1 or len(optimizers) != 1 or not loaders:
            raise UsageError(f"accelerator.prepare with {len(models)} model(s), {len(optimizers)} optimizer(s) and "
                             f"{len(loaders)} dataloader(s): hetrain plans the split by measuring the model on the "
                             "training data, with its optimizer", "prepare(model, optimizer, train_dataloader, "
                             "[eval_dataloader, ...], [lr_scheduler]) in one call")
        others = [o for o in objects if not any(o is x for x in (*models, *optimizers, *loaders, *schedulers))]
        if others:
            raise UsageError(f"accelerator.prepare({type(others[0]).__name__}): not a model, optimizer, DataLoader "
                             "or LR scheduler", "prepare those; keep anything else as it is")
        train = loaders[0]
        shuffle, drop_last = check_training_loader(train, self.hetrain)
        per_step = train.batch_size * self.gradient_accumulation_steps
        world = env_rank()[1]
        config = {"global_batch": per_step if self.split_batches else per_step * world, "shuffle": shuffle,
                  "drop_last": drop_last, **self.hetrain}
        config, layout = integration_layout(config)     # hetrain={'sharding': ...}: DataParallel's
        self.engine = engine = init(**config)                                              # (collective)
        model, optimizer, steps = engine.prepare(models[0], optimizers[0], train.dataset,
                                                 collate_fn=train.collate_fn, parallel=layout)   # (collective)
        self.run = run = Run(engine, steps, run_length_given="max_steps" in self.hetrain or "epochs" in self.hetrain,
                             accumulation=self.gradient_accumulation_steps)
        self.model = model
        # The plain loop settles a rank that leaves mid-step only after a forward of that step (the
        # first may run DDP's own collectives first); Fabric's wrapper counts them, here a hook does.
        model.register_forward_pre_hook(lambda module, args: run.plain.count_forward())
        if engine.job.precision.dtype is not None:
            autocast_forward(model, engine)
        made = {id(models[0]): model, id(optimizers[0]): StepOptimizer(run, optimizer),
                id(train): TrainLoader(run, train)}
        for loader in loaders[1:]:
            made[id(loader)] = evaluation.EvalLoader(self, loader)
        for i, scheduler in enumerate(schedulers):
            if getattr(scheduler, "optimizer", None) is not optimizer:
                raise UsageError("the LR scheduler's optimizer is not the one hetrain trains (its sharding may "
                                 "replace the optimizer)", "build the scheduler on the optimizer accelerator.prepare "
                                 "returns (its .optimizer), or use hetrain={'sharding': 'none'}")
            engine.register_state("lr_scheduler" if i == 0 else f"lr_scheduler_{i}", scheduler)
            made[id(scheduler)] = StepScheduler(run, scheduler)
        prepared = tuple(made[id(o)] for o in objects)
        return prepared[0] if len(prepared) == 1 else prepared

    def joined(self):
        if self.engine is None:
            raise UsageError("hetrain's Accelerator before accelerator.prepare(...)",
                             "call prepare(model, optimizer, train_dataloader, ...) first")
        return self.engine

    def shares(self) -> tuple[int, ...]:
        return tuple(self.joined().job.plan.shares)

    def to_device(self, batch):
        return to_device(batch, self.device)

    # -- the step -------------------------------------------------------------------------------
    def accumulate(self, *models):
        """A no-op context: hetrain syncs gradients once per step already (every micro-batch but a
        rank's last runs under no_sync), and steps once per global batch."""
        return contextlib.nullcontext()

    def no_sync(self, model):
        return contextlib.nullcontext()

    def autocast(self, *args, **kwargs):
        return self.joined().autocast()

    def backward(self, loss, **kwargs) -> None:
        """Weighted by this micro-batch's size (or `tokens=` under loss_weighting='tokens'), so the
        step's gradient is the whole global batch's, however unevenly the ranks share it."""
        tokens = kwargs.pop("tokens", None)
        if kwargs:
            raise UsageError(f"accelerator.backward(loss, {', '.join(kwargs)}=...) under hetrain",
                             "call accelerator.backward(loss)")
        self.joined().backward(loss, tokens=tokens)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2) -> None:
        """Clips in hetrain's step, after the agreement (the gradient is final only there): the
        global norm to `max_norm`. Returns None: the norm is measured inside the step."""
        if norm_type != 2:
            raise UsageError(f"clip_grad_norm_(norm_type={norm_type}) under hetrain", "use the 2-norm (the default)")
        job = self.joined().job
        if job.config.grad_clip != max_norm:
            job.config = replace(job.config, grad_clip=float(max_norm))

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        return model.module if hasattr(model, "module") and model is self.model else model

    # -- metrics --------------------------------------------------------------------------------
    def gather_for_metrics(self, data, use_gather_object: bool = False):
        """Inside an evaluation loader's loop: every rank's results for this batch, in dataset
        order, each sample once."""
        if self.run is not None and self.run.in_step:
            raise UsageError("gather_for_metrics inside the training loop: ranks run different numbers of "
                             "micro-batches, so a gather per batch would wait for a peer that has none left",
                             "gather in the evaluation loop (over a prepared eval dataloader), or read the step's "
                             "global loss after it: accelerator.step_loss")
        ev = self.current_eval
        padded, size = (ev.padded, ev.size) if ev is not None else (0, 0)
        if use_gather_object:
            return evaluation.gather_objects(data, padded=padded)
        return evaluation.gather(data, padded=padded, size=size, device=self.device)

    def gather(self, data):
        return self.gather_for_metrics(data)

    @property
    def step_loss(self) -> float | None:
        """The last finished step's loss over the whole global batch (the same on every rank)."""
        self.joined()
        return self.run.last_loss

    # -- state ----------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, **kwargs) -> str:
        """hetrain's exact checkpoint of the job (model, optimizer, schedulers, sampler position,
        RNG, plan) into output_dir/step-N, at a step boundary. A collective: every rank calls it."""
        engine = self.between_steps("save_state", output_dir, kwargs)
        with self.store(output_dir, engine) as store:
            persist.save(engine.job)
            return str(store.path(engine.job.steps_done))

    def load_state(self, input_dir: str | None = None, **kwargs) -> None:
        """Continue exactly from input_dir's newest checkpoint: after prepare, before the first
        step. The training loader then continues at the next sample (no skip_first_batches)."""
        engine = self.between_steps("load_state", input_dir, kwargs)
        if self.run.started:
            raise UsageError("accelerator.load_state after training started",
                             "call load_state right after accelerator.prepare(...), before the loop")
        with self.store(input_dir, engine) as store:
            path = store.latest()
            if path is None:
                raise UsageError(f"accelerator.load_state({input_dir!r}): no whole checkpoint there",
                                 "pass the directory save_state wrote")
            job = engine.job
            meta = store.read_meta(path)                                                  # (collective)
            if meta["model_signature"] != (job.model_signature or model_signature(job.model.module)):
                raise UsageError(f"checkpoint {path} was saved from a different model",
                                 "load the state of a run of the same model")
            if meta["global_batch"] != job.config.global_batch:
                raise UsageError(f"checkpoint {path} was saved with global batch {meta['global_batch']}, this run "
                                 f"has {job.config.global_batch}", "resume with the same batch_size, "
                                 "gradient_accumulation_steps and number of processes")
            persist.restore(job, persist.Found(path, meta))                               # (collective)

    def between_steps(self, verb: str, directory, kwargs):
        engine = self.joined()
        if kwargs:
            raise UsageError(f"accelerator.{verb}({', '.join(kwargs)}=...) under hetrain", f"call {verb}(directory)")
        if directory is None:
            raise UsageError(f"accelerator.{verb}() without a directory", f"call {verb}('path/to/dir')")
        if self.run.in_step:
            raise UsageError(f"accelerator.{verb} in the middle of a step",
                             "call it after optimizer.step() (when accelerator.sync_gradients) or between epochs")
        return engine

    @contextlib.contextmanager
    def store(self, directory: str, engine):
        """hetrain's checkpoint store on `directory`, as the job's for the duration."""
        job = engine.job
        store = Checkpointer(str(directory), keep=1 << 30, rank=job.rank, log=job.log)
        kept, job.checkpointer = job.checkpointer, store
        try:
            yield store
        finally:
            job.checkpointer = kept
            store.close()

    # -- the end and the rest -------------------------------------------------------------------
    def end_training(self) -> None:
        """Leave hetrain's job cleanly (a collective: every rank calls it)."""
        if self.engine is not None:
            self.engine.close()

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        raise UsageError("accelerator.skip_first_batches under hetrain: load_state already continues the training "
                         "loader at the next sample", "drop skip_first_batches (and any resume-step arithmetic)")

    def __getattr__(self, name: str):
        import accelerate

        if not name.startswith("_") and hasattr(accelerate.Accelerator, name):
            raise UsageError(f"accelerator.{name}: not part of hetrain's Accelerator (wrapped: prepare, accumulate, "
                             "backward, clip_grad_norm_, gather_for_metrics, save_state, load_state, print, "
                             "is_main_process, wait_for_everyone, unwrap_model, end_training)",
                             f"do it without Accelerate (on rank 0: `if accelerator.is_main_process:`); {FIX}")
        raise AttributeError(name)


def check_training_loader(loader: DataLoader, run_length: dict | None = None) -> tuple[bool, bool]:
    """(shuffle, drop_last) of the training DataLoader, or one UsageError for what hetrain's
    sampler cannot honour. `run_length`: the hetrain={...} keywords (max_steps, epochs)."""
    if loader.batch_size is None:
        raise UsageError("the training DataLoader has batch_sampler=... (no batch_size): hetrain forms each rank's "
                         "micro-batches from its share", "use DataLoader(dataset, batch_size=N, shuffle=...)")
    if loader.num_workers:
        raise UsageError(f"the training DataLoader has num_workers={loader.num_workers}: hetrain forms each rank's "
                         "micro-batches from its share of every step, so the DataLoader's own workers would read "
                         "batches no rank trains on",
                         f"remove num_workers= and pass Accelerator(hetrain={{'num_workers': {loader.num_workers}}}): "
                         "hetrain's workers read each micro-batch")
    if is_stream(loader.dataset):
        # An IterableDataset's sampler is torch's stand-in: the stream's own order is the order, read
        # as ht.prepare reads a stream (runtime/loop/stream.py), every rank its share of each step.
        run_length = run_length or {}
        if stream_length(loader.dataset) is None and "max_steps" not in run_length:
            raise UsageError(f"the training DataLoader reads an IterableDataset without a length "
                             f"({type(loader.dataset).__name__}): its passes' steps cannot be counted"
                             + (", so hetrain={'epochs': ...} cannot end the run" if "epochs" in run_length else ""),
                             "pass Accelerator(hetrain={'max_steps': N}) (or give the dataset a __len__)")
        return False, loader.drop_last
    if type(loader.sampler) not in (RandomSampler, SequentialSampler) or not hasattr(loader.dataset, "__len__"):
        raise UsageError(f"the training DataLoader's sampler is a {type(loader.sampler).__name__}: hetrain's own "
                         "sampler picks every step's samples (one stream, cut by the plan)",
                         "use DataLoader(dataset, batch_size=N, shuffle=True) or shuffle=False")
    return isinstance(loader.sampler, RandomSampler), loader.drop_last


def autocast_forward(model, engine) -> None:
    """Every forward through the prepared model in this device's precision, as Accelerate's
    mixed_precision wraps forward (a pre-hook enters hetrain's autocast, the hook leaves it)."""
    entered = []

    def enter(module, args):
        ctx = engine.autocast()
        ctx.__enter__()
        entered.append(ctx)

    def leave(module, args, output):
        entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
