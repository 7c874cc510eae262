"""hetrain's Accelerator: accelerate.Accelerator itself, with the distribution hetrain's.

A subclass, so every attribute of the stock class is there and does what it does: the process
facts (num_processes, is_main_process, distributed_type), main_process_first, print,
wait_for_everyone, split_between_processes, the trackers (log_with, init_trackers, log),
save_model, get_state_dict, reduce, pad_across_processes, free_memory... What differs is what
decides how the batches are split and when gradients meet, each overridden here: prepare (the
training DataLoader becomes hetrain's uneven shares of each global batch, the evaluation ones an
uneven split, accel/loop.py and accel/evaluation.py), backward (weighted by the micro-batch's size),
accumulate / no_sync (hetrain syncs once per step already), clip_grad_norm_ (in the agreed step),
gather_for_metrics, autocast, save_state / load_state (hetrain's exact checkpoints, accel/state.py)
and skip_first_batches.

hetrain joins the process group in __init__, before the stock constructor, which then finds the
group made and uses it. The global batch is stock Accelerate's on this many equal GPUs: the
training DataLoader's batch_size x gradient_accumulation_steps x processes (split_batches=True:
batch_size x gradient_accumulation_steps), as hetrain's Trainer does; batch_size is the mean share.
"""

from __future__ import annotations

import contextlib
import inspect

import accelerate
import torch
from torch.utils.data import DataLoader

from ...errors import UsageError
from ...runtime.config import integration_layout
from ...runtime.engine import init
from ...runtime.ranks.dist import env_rank
from ...runtime.resilience.worker_errors import install_excepthook
from ...runtime.user_objects import to_device
from . import evaluation, state
from .checks import PRECISIONS, autocast_forward, batch_forward, check_arguments, check_dispatch, check_training_loader
from .loop import Run, StepOptimizer, StepScheduler, TrainLoader

STOCK = inspect.signature(accelerate.Accelerator.__init__)
NAMES = {None: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Accelerator(accelerate.Accelerator):
    """`from hetrain.integrations.accelerate import Accelerator`: an Accelerate script across mixed
    devices. `hetrain={...}` passes hetrain.init's keywords (precision='auto', sharding, max_steps
    or epochs to cap the run, seed, ...). Launch with `hetrain run` (docs/integrations.md, Accelerate)."""

    def __init__(self, *args, hetrain: dict | None = None, **kwargs):
        install_excepthook(*env_rank(), lambda: None)          # from here on, bad input is one line
        given = STOCK.bind(self, *args, **kwargs).arguments
        given.pop("self")
        check_arguments(given)
        self.hetrain = dict(hetrain or {})
        precision = given.get("mixed_precision")
        self.hetrain.setdefault("precision", PRECISIONS[getattr(precision, "value", precision)])
        loading = given.get("dataloader_config")
        config, self.layout = integration_layout({k: v for k, v in self.hetrain.items() if k != "plan"})
        if loading is not None and loading.data_seed is not None:
            config.setdefault("seed", loading.data_seed)
        # The global batch is the training DataLoader's, known at prepare (which sets it).
        self.engine = engine = init(plan=self.hetrain.get("plan"), **{"global_batch": 1, **config})   # (collective)
        given["mixed_precision"] = "no"         # hetrain's autocast and loss scale, each device its own
        given["cpu"] = bool(given.get("cpu")) or engine.device.type == "cpu"
        super().__init__(**given)
        self.run: Run | None = None
        self.model = None
        self.prepared: dict = {}         # id(the user's object) -> what prepare returned for it
        self.train_loader = None         # the user's training DataLoader (prepare's first)
        self.current_eval = None         # the evaluation loader being iterated (gather_for_metrics)

    # -- the facts hetrain decides ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def mixed_precision(self) -> str:
        """What this process computes in: 'no', 'bf16' or 'fp16' (under precision='auto', its device's)."""
        return NAMES.get(self.engine.compute_dtype, "no")

    @property
    def sync_gradients(self) -> bool:
        """True on this rank's last micro-batch of a step (and outside the training loop)."""
        return self.run is None or self.run.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def step_loss(self) -> float | None:
        """The last finished step's loss over the whole global batch (the same on every rank)."""
        self.joined()
        return self.run.last_loss

    def joined(self):
        """hetrain's engine of the job, once prepare() started it."""
        if self.run is None:
            raise UsageError("hetrain's Accelerator before accelerator.prepare(model, optimizer, train_dataloader)",
                             "call prepare(model, optimizer, train_dataloader, ...) first")
        return self.engine

    def shares(self) -> tuple[int, ...]:
        return tuple(self.engine.plan.shares)

    def to_device(self, batch):
        return to_device(batch, self.device)

    # -- prepare --------------------------------------------------------------------------------
    def prepare(self, *objects, device_placement=None):
        """The model, its optimizer and the training DataLoader (the first one) in the first call;
        evaluation DataLoaders, LR schedulers and models only evaluated in it or in later calls.
        Returned in the order given."""
        if self.run is None:
            self.start(objects)
        prepared = tuple(self.prepare_object(o) for o in objects)
        return prepared[0] if len(prepared) == 1 else prepared

    def start(self, objects) -> None:
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        loaders = [o for o in objects if isinstance(o, DataLoader)]
        if len(optimizers) != 1 or not models or not loaders:
            raise UsageError(f"accelerator.prepare with {len(models)} model(s), {len(optimizers)} optimizer(s) and "
                             f"{len(loaders)} dataloader(s) first: hetrain plans the split by measuring the model on "
                             "the training data, with its optimizer", "prepare(model, optimizer, train_dataloader, "
                             "[eval_dataloader, ...], [lr_scheduler]) in one call")
        optimizer = optimizers[0]
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trained = [m for m in models if any(id(p) in held for p in m.parameters())] or models[:1]
        train = self.train_loader = loaders[0]
        shuffle, drop_last = check_training_loader(train, self.hetrain)
        per_step = train.batch_size * self.gradient_accumulation_steps
        world = self.num_processes
        settings = {"global_batch": per_step if self.split_batches else per_step * world, "shuffle": shuffle,
                    "drop_last": drop_last, "num_workers": train.num_workers}
        self.engine.configure(**{k: v for k, v in settings.items() if k not in self.hetrain})
        model, optimizer, steps = self.engine.prepare(trained[0], optimizer, train.dataset, parallel=self.layout,
                                                      collate_fn=train.collate_fn, forward=batch_forward)  # (collective)
        check_dispatch(self.dataloader_config, self.engine.plan.shares)       # (the same plan on every rank)
        self.run = run = Run(self.engine, steps, accumulation=self.gradient_accumulation_steps,
                             run_length_given="max_steps" in self.hetrain or "epochs" in self.hetrain,
                             scheduler_steps=1 if self.split_batches else world)
        self.model = model
        # The plain loop settles a rank that leaves mid-step only after a forward of that step (the
        # first may run DDP's own collectives first); Fabric's wrapper counts them, here a hook does.
        model.register_forward_pre_hook(lambda module, args: run.plain.count_forward())
        if self.engine.compute_dtype is not None:
            autocast_forward(model, self.engine)
        self.prepared = {id(trained[0]): model, id(optimizers[0]): StepOptimizer(run, optimizer),
                         id(train): TrainLoader(run, train)}
        self._models.append(model)
        self._optimizers.append(self.prepared[id(optimizers[0])])

    def prepare_object(self, obj):
        if id(obj) in self.prepared:
            return self.prepared[id(obj)]
        if isinstance(obj, DataLoader):
            made = evaluation.EvalLoader(self, obj)
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            made = self.prepare_scheduler(obj)
        elif isinstance(obj, torch.nn.Module):
            made = self.prepare_model(obj, evaluation_mode=True)
        elif isinstance(obj, torch.optim.Optimizer):
            raise UsageError("accelerator.prepare with a second optimizer: hetrain steps one optimizer per model",
                             "put every parameter group in one optimizer and prepare it with the model")
        else:
            return obj           # as stock: what prepare does not know passes through
        self.prepared[id(obj)] = made
        return made

    def prepare_model(self, model, device_placement=None, evaluation_mode: bool = False):
        """A model only evaluated (a frozen teacher, a reference model): on this rank's device, in
        its precision. The trained one goes to prepare() with its optimizer and training data."""
        if self.run is not None and id(model) in self.prepared:
            return self.prepared[id(model)]
        if not evaluation_mode:
            raise UsageError("accelerator.prepare_model(model) on its own: hetrain plans the split by measuring the "
                             "model with its optimizer on the training data", "pass the model, its optimizer and the "
                             "training DataLoader to one accelerator.prepare(...) (or evaluation_mode=True)")
        model = model.to(self.device)
        if self.engine.compute_dtype is not None:
            autocast_forward(model, self.engine)
        return model

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        self.joined()
        return self.prepare_object(data_loader)

    def prepare_optimizer(self, optimizer, device_placement=None):
        self.joined()
        return self.prepare_object(optimizer)

    def prepare_scheduler(self, scheduler):
        self.joined()
        run = self.run
        if getattr(scheduler, "optimizer", None) is not run.engine.optimizer:
            raise UsageError("the LR scheduler's optimizer is not the one hetrain trains (its sharding may replace "
                             "the optimizer)", "build the scheduler on the optimizer accelerator.prepare returns, "
                             "or use Accelerator(hetrain={'sharding': 'none'})")
        names = ["lr_scheduler"] + [f"lr_scheduler_{i}" for i in range(1, len(self._schedulers) + 1)]
        self.engine.register_state(names[len(self._schedulers)], scheduler)
        made = StepScheduler(run, scheduler, with_optimizer=self.step_scheduler_with_optimizer)
        self._schedulers.append(made)
        return made

    # -- the step -------------------------------------------------------------------------------
    def accumulate(self, *models):
        """hetrain syncs gradients once per step already (every micro-batch but a rank's last runs
        under no_sync) and steps once per global batch."""
        return contextlib.nullcontext()

    def no_sync(self, model):
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, model):
        return contextlib.nullcontext()

    def join_uneven_inputs(self, joinables, even_batches=None):
        """Every rank runs every step (its share may be larger or smaller): nothing to join."""
        return contextlib.nullcontext()

    def autocast(self, autocast_handler=None):
        return self.engine.autocast()

    def backward(self, loss, **kwargs) -> None:
        """Weighted by this micro-batch's size (or `tokens=` under loss_weighting='tokens'), so the
        step's gradient is the whole global batch's, however unevenly the ranks share it; not
        divided by gradient_accumulation_steps (the weight counts the whole global batch)."""
        tokens = kwargs.pop("tokens", None)
        if kwargs:
            raise UsageError(f"accelerator.backward(loss, {', '.join(kwargs)}=...) under hetrain",
                             "call accelerator.backward(loss)")
        self.joined()
        self.engine.backward(loss, tokens=tokens)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Clips in hetrain's step, after the agreement (the gradient is final only there): the
        global norm to `max_norm`. Returns None: the norm is measured inside the step."""
        if norm_type != 2:
            raise UsageError(f"clip_grad_norm_(norm_type={norm_type}) under hetrain", "use the 2-norm (the default)")
        self.engine.set_grad_clip(max_norm)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if model is self.model and hasattr(model, "module"):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    # -- metrics --------------------------------------------------------------------------------
    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """Inside an evaluation loader's loop: every rank's results for this batch, in dataset
        order, each sample once. Elsewhere: every rank's, in rank order."""
        if self.run is not None and self.run.in_step:
            raise UsageError("gather_for_metrics inside the training loop: ranks run different numbers of "
                             "micro-batches, so a gather per batch would wait for a peer that has none left",
                             "gather in the evaluation loop (over a prepared eval dataloader), or read the step's "
                             "global loss after it: accelerator.step_loss")
        ev = self.current_eval
        padded, size = (ev.padded, ev.size) if ev is not None else (0, 0)
        if use_gather_object or not evaluation.all_tensors(input_data):
            return evaluation.gather_objects(input_data, padded=padded)
        return evaluation.gather(input_data, padded=padded, size=size, device=self.device)

    def gather(self, tensor):
        """Every rank's tensors, in rank order (the ranks' batches may differ in size here)."""
        return evaluation.gather(tensor, padded=0, size=0, device=self.device)

    # -- state ----------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs) -> str:
        """hetrain's exact checkpoint of the job into output_dir/step-N, at a step boundary."""
        self.joined()
        return state.save(self.engine, self.run, output_dir)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs) -> None:
        """Continue exactly from input_dir's newest checkpoint: after prepare, before the loop."""
        self.joined()
        state.load(self.engine, self.run, input_dir)

    def register_for_checkpointing(self, *objects) -> None:
        for obj in objects:
            self.engine.register_state(f"custom_checkpoint_{len(self._custom_objects)}", obj)
            self._custom_objects.append(obj)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """After load_state the prepared training loader continues at the next sample already: it
        is returned as it is. Any other loader: stock's."""
        if self.run is None or dataloader is not self.prepared.get(id(self.train_loader)):
            return super().skip_first_batches(dataloader, num_batches)
        if num_batches and not self.run.restored:
            raise UsageError(f"accelerator.skip_first_batches(train_dataloader, {num_batches}) without load_state: "
                             "hetrain's loader skips by its checkpointed position, not by batches",
                             "call accelerator.load_state(dir) after prepare; the loader then continues where the "
                             "checkpoint was saved")
        return dataloader

    # -- the end --------------------------------------------------------------------------------
    def end_training(self) -> None:
        """The trackers' end, then leave hetrain's job cleanly (a collective: every rank calls it)."""
        for tracker in self.trackers:
            tracker.finish()
        self.engine.close()
