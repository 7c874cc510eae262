"""hetrain's Trainer: the Hugging Face Trainer with hetrain's loop inside train().

Why a subclass that replaces train() and not callbacks or a custom accelerator: the Trainer's loop
(`_inner_training_loop`) runs the same number of batches of the same size on every rank, with
gradient accumulation counted in batches; under hetrain each rank runs its own share, in its own
number of micro-batches, and the step is agreed by the ranks. No callback can change how many
forwards a rank runs. So train() is hetrain's loop, written after stock's `_run_epoch` and
`_maybe_log_save_evaluate` (transformers 5): the same callbacks in the same order with the same
arguments (model, optimizer, lr_scheduler, train_dataloader), the control flags of
DefaultFlowCallback deciding when to log, evaluate and save, the learning rate logged as the one the
step used, the loss as the mean of the steps since the last log, grad_norm before clipping,
total_flos summed over the ranks. How TrainingArguments map, and the global batch rule:
arguments.py; the checkpoints: checkpoints.py; evaluation split over the ranks: evaluation.py.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import TrainOutput, speed_metrics

from ...errors import UsageError
from ...runtime.config import integration_layout
from ...runtime.engine import init
from ...runtime.loop.stream import is_stream, stream_length
from ...runtime.ranks.collectives import collective_device
from ...runtime.ranks.dist import env_rank
from ...runtime.resilience.worker_errors import install_excepthook
from . import checkpoints, evaluation
from .arguments import conflicts, job_config, no_max_steps


FSDP_EVAL = ("evaluation with hetrain's FSDP2 sharding: each rank runs its own part of the batches, and a "
             "sharded model needs every rank in every forward")
FSDP_EVAL_FIX = 'shard with hetrain={"sharding": "zero1"} or "none", or use eval_strategy="no"'


class _NotDistributedWarning(logging.Filter):
    """transformers warns, when TrainingArguments meets a process group it did not make, that
    parallel_mode is not DISTRIBUTED: under hetrain that is by design (hetrain owns the group and
    the split), so the warning would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "parallel_mode != ParallelMode.DISTRIBUTED" not in record.getMessage()


logging.getLogger("transformers.training_args").addFilter(_NotDistributedWarning())


class Trainer(transformers.Trainer):
    """`transformers.Trainer` across mixed devices: the one changed line of a stock script is the
    import. `hetrain={...}` passes hetrain.init's other keywords (precision='auto', sharding,
    micro_batch, ...). Launch with `hetrain run train.py` (docs/integrations.md, Hugging Face Trainer)."""

    def __init__(self, *args, hetrain: dict | None = None, **kwargs):
        install_excepthook(*env_rank(), lambda: None)       # from here on, bad input is one line
        # Not .bind(): a subclass (TRL's trainers) passes keywords of its own (ref_model, ...) through here.
        positional = list(inspect.signature(transformers.Trainer.__init__).parameters)[1:]
        given = {**dict(zip(positional, args)), **kwargs}
        stream, arguments = given.get("train_dataset"), given.get("args")
        if stream is not None and is_stream(stream) and stream_length(stream) is None and (
                arguments is None or arguments.max_steps <= 0):
            raise no_max_steps()     # before stock's own check says it as a ValueError
        super().__init__(*args, **kwargs)
        conflicts(self.args, model_init=self.model_init)    # at construction: before any work is done
        self.hetrain = dict(hetrain or {})
        self.engine = None              # hetrain's job, while train() runs
        self.hetrain_summary: dict | None = None   # after train(): hetrain's run figures (ht.summary())
        self.hetrain_plan = None                     # after train(): the Plan the run ended on

    # The job's ranks, not Accelerate's: a launch Accelerate does not read as distributed (it made
    # no process group) would make every rank the main one, and every rank write the checkpoints.
    def is_world_process_zero(self) -> bool:
        return env_rank()[0] == 0

    def is_local_process_zero(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs) -> TrainOutput:
        if trial is not None or kwargs:
            raise UsageError(f"hetrain's Trainer.train got {'trial=...' if trial is not None else ', '.join(kwargs)}",
                             "call trainer.train() or trainer.train(resume_from_checkpoint=...); searches are "
                             "`hetrain sweep`")
        args = self.args
        world = dist.get_world_size() if dist.is_initialized() else env_rank()[1]
        dataset = self.train_data()
        config = job_config(args, world_size=world, dataset_len=stream_length(dataset), hetrain=self.hetrain)
        saves = "dir" in config.get("checkpoints", {})        # save_strategy != 'no' (arguments.job_config)
        if resume_from_checkpoint not in (None, False) and not saves:
            raise UsageError("trainer.train(resume_from_checkpoint=...) with save_strategy='no'",
                             "use save_strategy='steps' or 'epoch', the one the run saved with")
        # A restart under `hetrain run --max-restarts` continues; a first launch starts afresh, as the
        # stock Trainer does, beside any checkpoints already in output_dir (checkpoints.py).
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        resume = checkpoints.plan(args.output_dir, resume_from_checkpoint, restarted=restarted) if saves else None
        if resume is not None:
            config["checkpoints"].update(dir=resume.store, resume=resume.mode)
        # hetrain clips in the optimizer's step pre-hook (clip_and_measure): the norm is stock's grad_norm
        self.max_grad_norm, config["grad_clip"] = config["grad_clip"], None
        config, self.hetrain_layout = integration_layout(config)   # hetrain={'sharding': ...}: DataParallel's
        self.engine = engine = init(**config)                                               # (collective)
        self.is_in_train = True
        try:
            if resume is not None:
                checkpoints.link(resume, rank=engine.rank)                                 # (collective)
            return self.run(engine, dataset, resume, ignore_keys_for_eval)
        finally:
            self.engine, self.is_in_train = None, False
            engine.close()

    def train_data(self):
        if self.train_dataset is None:
            raise UsageError("hetrain's Trainer.train() without a train_dataset", "pass Trainer(train_dataset=...)")
        dataset = self.train_dataset
        if is_stream(dataset):           # read as hetrain.prepare reads a stream (runtime/loop/stream.py)
            return dataset
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise UsageError(f"train_dataset is a {type(dataset).__name__} without __len__ or __getitem__: hetrain "
                             "picks each step's samples by index from one global stream, cut unevenly by the plan",
                             "pass a map-style dataset, a datasets.Dataset or a torch Dataset with __len__")
        if self.args.remove_unused_columns and type(dataset).__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description="training")     # the Trainer's own rule
        return dataset

    def prepare_run(self, engine, dataset, resume):
        """prepare() and the Trainer's objects around it, as stock's _prepare_for_training and
        _init_training_state leave them. Returns the model hetrain wrapped."""
        args = self.args
        self.create_optimizer()
        # A stream's unused columns are dropped by the collator, as stock drops them for any dataset
        # that is not a datasets.Dataset (train_data drops a Dataset's own).
        collate = self._get_collator_with_removed_columns(self.data_collator, description="training") \
            if is_stream(dataset) else self.data_collator
        model, optimizer, steps = engine.prepare(self.model, self.optimizer, dataset, collate_fn=collate,
                                                 parallel=self.hetrain_layout)                 # (collective)
        if self.lr_scheduler is not None and getattr(self.lr_scheduler, "optimizer", None) is not optimizer:
            raise UsageError("Trainer(optimizers=(optimizer, scheduler)): hetrain's sharding replaced the optimizer, "
                             "and the scheduler holds the old one",
                             "pass optimizers=(optimizer, None) and lr_scheduler_type=..., or shard with "
                             'hetrain={"sharding": "none"}')
        if args.eval_strategy != "no" and any(hasattr(p, "full_tensor") for p in self.model.parameters()):
            raise UsageError(FSDP_EVAL, FSDP_EVAL_FIX)      # before the first step, not at the first evaluation
        self.optimizer = optimizer
        self.create_scheduler(num_training_steps=engine.total_steps, optimizer=optimizer)
        engine.register_state("lr_scheduler", self.lr_scheduler)         # restored here on resume
        self.state = TrainerState(stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                                      if isinstance(cb, ExportableState)])
        self.state.train_batch_size = args.per_device_train_batch_size   # the mean share (arguments.py)
        self.state.compute_steps(args, engine.total_steps)
        if resume is not None and resume.checkpoint is not None:
            self.state = TrainerState.load_from_json(str(resume.checkpoint / checkpoints.TRAINER_STATE))
            self._load_callback_state()
        self.state.init_training_references(self, engine.total_steps, args.num_train_epochs, None)
        self.state.max_steps, self.state.global_step = engine.total_steps, engine.steps_done
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))
        # What a callback reads of stock's train_dataloader (its dataset, its batch size); hetrain's
        # sampler, not this loader, feeds the ranks.
        self.callback_handler.train_dataloader = DataLoader(dataset, batch_size=args.per_device_train_batch_size,
                                                            collate_fn=self.data_collator)
        self.step_norm = None
        optimizer.register_step_pre_hook(lambda opt, a, kw: self.clip_and_measure(engine))
        return model, steps

    def clip_and_measure(self, engine) -> None:
        """The optimizer's pre-step hook: stock's clip and grad_norm (the norm before clipping, inf
        when max_grad_norm is 0: measured, not clipped), then on_pre_optimizer_step. After the
        token correction, as hetrain's own clip; not reached on a step skipped for fp16 overflow."""
        limit = self.max_grad_norm or float("inf")
        norm = engine.clip_grad_norm(limit)    # capacity-full: the slices' norms summed over the ranks
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm     # FSDP2: a DTensor
        self.step_norm = float(norm)
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)

    def run(self, engine, dataset, resume, ignore_keys) -> TrainOutput:
        args = self.args
        model, steps = self.prepare_run(engine, dataset, resume)
        # stock's accumulator: a float32 tensor (its rounding is what stock logs)
        self.current_flos, self.tr_loss, self.total_loss = 0.0, torch.tensor(0.0), 0.0
        first = self.last_logged = engine.steps_done
        started, count = time.time(), self.token_counter()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and first == 0:
            self._evaluate(None, ignore_keys, skip_scheduler=True)
        epoch = int(self.state.epoch or 0)
        self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
        for step in steps:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            model.train()
            flops = {}                  # per sample: a micro-batch redone after an OOM counts once
            for mb in step:
                with mb:
                    batch, tokens = mb.batch, count(mb.batch) if count else None
                    with engine.autocast():     # a copy: compute_loss pops 'labels' from what it is given
                        loss = self.compute_loss(model, dict(batch) if isinstance(batch, Mapping) else batch)
                    engine.backward(loss, tokens=tokens)
                if mb.failed is None:
                    flops.update(dict.fromkeys(mb.indices, float(self.floating_point_ops(batch)) / mb.size))
            self.step_norm = float("nan")           # stays so on a step skipped for fp16 overflow
            engine.step()
            self.current_flos += sum(flops.values())
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
            learning_rate = self._get_learning_rate()      # the rate this step used: stock logs it
            if not engine.step_skipped(step.index):
                self.lr_scheduler.step()
            self.tr_loss += torch.tensor(step.loss)
            self.state.global_step, self.state.epoch = step.index + 1, self.epoch_of(step, stream_length(dataset))
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self.log_and_evaluate(learning_rate, started, ignore_keys)
            last = self.state.global_step == engine.total_steps
            if int(self.state.epoch) > epoch or last:
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                self.log_and_evaluate(learning_rate, started, ignore_keys)
                epoch = int(self.state.epoch)
                if not last:
                    self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            every = engine.config.checkpoints.every if engine.config.checkpoints.dir else None
            if every and (self.state.global_step % every == 0 or last):    # hetrain saved this step
                self.store_flos()
                checkpoints.write(self, self.model, self.state.global_step, engine.config.checkpoints.dir)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.agreed_stop(engine, last):
                break
        return self.finish(engine, started, first)

    def log_and_evaluate(self, learning_rate: float, started: float, ignore_keys) -> None:
        """Stock's _maybe_log_save_evaluate, without the save (hetrain saves on its own schedule)."""
        if self.control.should_log and self.state.global_step > self.last_logged:
            loss = self.tr_loss.item()
            logs = {"loss": loss / (self.state.global_step - self.last_logged), "grad_norm": self.step_norm,
                    "learning_rate": learning_rate}
            self.total_loss += loss
            self.tr_loss, self.last_logged = torch.tensor(0.0), self.state.global_step
            self.store_flos()
            self.log(logs, started)
        if self.control.should_evaluate:
            metrics = self._evaluate(None, ignore_keys)
            self._determine_best_metric(metrics=metrics, trial=None)

    def finish(self, engine, started: float, first: int) -> TrainOutput:
        """Stock's _finalize_training: the run's metrics, the best model loaded at the end."""
        self.hetrain_summary, self.hetrain_plan = engine.summary(), engine.plan              # (collective)
        self.total_loss += self.tr_loss.item()
        done = self.state.global_step - first
        metrics = speed_metrics("train", started, num_samples=done * engine.config.global_batch, num_steps=done)
        self.store_flos()
        metrics["total_flos"], metrics["train_loss"] = self.state.total_flos, self.total_loss / max(done, 0.001)
        self.log(dict(metrics))
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()          # every rank, from the checkpoint rank 0 wrote
        if engine.config.checkpoints.dir:
            checkpoints.keep_best_only(self)                                                  # (collective)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def store_flos(self) -> None:
        """Stock's, summed over hetrain's ranks (the Trainer does not see them as distributed). Collective:
        the sum is made on the job's device (a CUDA job's NCCL group takes no CPU tensor)."""
        flos = float(self.current_flos)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = self.engine.device if self.engine is not None else collective_device()
            total = torch.tensor([flos], dtype=torch.float64, device=device)
            dist.all_reduce(total)
            flos = total.item()
        self.state.total_flos += flos
        self.current_flos = 0.0

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """On several ranks: each a part of the batches, in proportion to its share of the run's
        plan (evaluation.py), during train() and after it; on one, stock's."""
        plan = self.engine.plan if self.engine is not None else self.hetrain_plan
        if not dist.is_initialized() or dist.get_world_size() == 1 or description != "Evaluation":
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        if any(hasattr(p, "full_tensor") for p in self.model.parameters()):
            raise UsageError(FSDP_EVAL, FSDP_EVAL_FIX)
        shares = list(plan.shares) if plan is not None else [1] * dist.get_world_size()
        return evaluation.evaluation_loop(self, dataloader, rank=dist.get_rank(), shares=shares,
                                          prediction_loss_only=prediction_loss_only, ignore_keys=ignore_keys,
                                          metric_key_prefix=metric_key_prefix)

    def token_counter(self):
        """Under hetrain={'loss_weighting': 'tokens'}: batch -> the tokens its loss averaged over
        (labels that are not -100; a causal LM predicts each from the one before it, so one fewer);
        None under the default sample weighting. Decided once per run, not per micro-batch."""
        if self.engine.config.loss_weighting != "tokens":
            return None
        base = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model   # PEFT's wrapper
        shift = 1 if type(base).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else 0   # as compute_loss tells

        def count(batch) -> int:
            labels = batch.get("labels") if isinstance(batch, Mapping) else None
            if labels is None:
                raise UsageError("loss_weighting='tokens' but the batch has no 'labels'",
                                 "give the dataset 'labels', or use the default loss_weighting='samples'")
            return int((labels[..., shift:] != -100).sum())

        return count

    def epoch_of(self, step, samples: int | None) -> float:
        """The Trainer's fractional epoch: the samples of the steps done over the dataset's length
        (a stream without one: the run, max_steps, is one epoch)."""
        if samples is None:
            return (step.index + 1) / self.engine.total_steps
        return (step.index + 1) * self.engine.config.global_batch / max(1, samples)

    def agreed_stop(self, engine, last: bool) -> bool:
        """A callback's should_training_stop, agreed by every rank (one may be alone in asking)."""
        flag = torch.tensor([1.0 if self.control.should_training_stop and not last else 0.0], device=engine.device)
        if dist.is_initialized() and engine.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

