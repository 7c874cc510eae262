"""hetrain's Trainer: the Hugging Face Trainer with hetrain's loop inside train().

Why a subclass that replaces train() and not callbacks or a custom accelerator: the Trainer's loop
(`_inner_training_loop`) runs the same number of batches of the same size on every rank, with
gradient accumulation counted in batches; under hetrain each rank runs its own share, in its own
number of micro-batches, and the step is agreed by the ranks. No callback can change how many
forwards a rank runs. So train() is hetrain's loop, and it keeps the Trainer's documented
extension points: create_optimizer / create_scheduler (or `optimizers=`), compute_loss (so
compute_loss_func, label smoothing and a subclass's own loss still apply), data_collator,
callbacks (on_train_begin, on_step_begin/end, on_log, on_save, on_train_end), log() and
TrainerState. How TrainingArguments map, and the global batch rule: arguments.py. The
checkpoints: checkpoints.py.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput

from ...errors import UsageError
from ...runtime.engine import init
from ...runtime.ranks.dist import env_rank
from ...runtime.resilience.worker_errors import install_excepthook
from . import checkpoints
from .arguments import conflicts, job_config


class Trainer(transformers.Trainer):
    """`transformers.Trainer` across mixed devices: the one changed line of a stock script is the
    import. `hetrain={...}` passes hetrain.init's other keywords (precision='auto', sharding,
    micro_batch, emulate, ...). Launch with `hetrain run [--emulate a100-80g,rtx3090] train.py`."""

    def __init__(self, *args, hetrain: dict | None = None, **kwargs):
        install_excepthook(*env_rank(), lambda: None)       # from here on, bad input is one line
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
            raise UsageError(f"hetrain's Trainer.train({'trial=...' if trial is not None else ', '.join(kwargs)})",
                             "call trainer.train() or trainer.train(resume_from_checkpoint=...); searches are "
                             "`hetrain sweep`")
        args = self.args
        world = dist.get_world_size() if dist.is_initialized() else env_rank()[1]
        dataset = self.train_data()
        config = job_config(args, world_size=world, dataset_len=len(dataset), hetrain=self.hetrain)
        saves = "dir" in config.get("checkpoints", {})        # save_strategy != 'no' (arguments.job_config)
        found = checkpoints.find(args.output_dir, resume_from_checkpoint) if saves else None
        if resume_from_checkpoint not in (None, False) and not saves:
            raise UsageError("trainer.train(resume_from_checkpoint=...) with save_strategy='no'",
                             "use save_strategy='steps' (or 'epoch'), the one the run saved with")
        # A restart under `hetrain run --max-restarts` continues; a first launch starts fresh, as the
        # stock Trainer does, and is refused if output_dir already holds hetrain's checkpoints.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        config.setdefault("checkpoints", {})["resume"] = "must" if found else "auto" if restarted else "never"
        self.engine = engine = init(**config)                                               # (collective)
        try:
            return self.run(engine, dataset, found)
        finally:
            self.engine = None
            engine.close()

    def train_data(self):
        if self.train_dataset is None:
            raise UsageError("hetrain's Trainer.train() without a train_dataset", "pass Trainer(train_dataset=...)")
        dataset = self.train_dataset
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise UsageError(f"train_dataset is a {type(dataset).__name__} without __len__/__getitem__: hetrain picks "
                             "each step's samples by index from one global stream, cut unevenly by the plan",
                             "pass a map-style dataset (a datasets.Dataset, or a torch Dataset with __len__)")
        if self.args.remove_unused_columns and type(dataset).__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description="training")     # the Trainer's own rule
        return dataset

    def run(self, engine, dataset, found) -> TrainOutput:
        args = self.args
        self.create_optimizer()
        given = self.optimizer
        model, optimizer, steps = engine.prepare(self.model, given, dataset, collate_fn=self.data_collator,
                                                 parallel="dp")                                # (collective)
        if self.lr_scheduler is not None and getattr(self.lr_scheduler, "optimizer", None) is not optimizer:
            raise UsageError("Trainer(optimizers=(optimizer, scheduler)): hetrain's sharding replaced the optimizer, "
                             "and the scheduler holds the old one",
                             "pass optimizers=(optimizer, None) and lr_scheduler_type=..., or shard with "
                             'hetrain={"sharding": "none"}')
        self.optimizer = optimizer
        self.create_scheduler(num_training_steps=engine.total_steps, optimizer=optimizer)
        engine.register_state("lr_scheduler", self.lr_scheduler)         # restored here on resume
        if found is not None:
            self.state = TrainerState.load_from_json(str(found[1] / checkpoints.TRAINER_STATE))
        self.state.max_steps, self.state.global_step = engine.total_steps, engine.steps_done
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.logging_steps, self.state.save_steps = args.logging_steps, args.save_steps
        every = engine.job.config.checkpoints.every if engine.job.config.checkpoints.dir else None
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        started, losses, first, count = time.time(), [], engine.steps_done, self.token_counter()
        for step in steps:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            for mb in step:
                with mb:
                    batch, tokens = mb.batch, count(mb.batch) if count else None
                    with engine.autocast():     # a copy: compute_loss pops 'labels' from what it is given
                        loss = self.compute_loss(model, dict(batch) if isinstance(batch, dict) else batch)
                    engine.backward(loss, tokens=tokens)
            engine.step()
            self.lr_scheduler.step()
            losses.append(step.loss)
            self.state.global_step, self.state.epoch = step.index + 1, self.epoch_of(step, len(dataset))
            if args.logging_steps and (self.state.global_step % args.logging_steps == 0 or
                                       (args.logging_first_step and step.index == first)):
                self.log({"loss": step.loss, "learning_rate": self.lr_scheduler.get_last_lr()[0],
                          "samples_per_s": step.samples_per_s or 0.0}, start_time=started)
            last = self.state.global_step == engine.total_steps
            if every and (self.state.global_step % every == 0 or last):
                checkpoints.write(self, self.model, self.state.global_step, keep=engine.job.config.checkpoints.keep)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.agreed_stop(engine, last):
                break
        self.hetrain_summary, self.hetrain_plan = engine.summary(), engine.job.plan              # (collective)
        runtime = time.time() - started
        done = self.state.global_step - first
        metrics = {"train_runtime": runtime, "train_loss": sum(losses) / max(1, len(losses)),
                   "train_samples_per_second": done * engine.job.config.global_batch / max(runtime, 1e-9),
                   "train_steps_per_second": done / max(runtime, 1e-9), "epoch": self.state.epoch}
        self.log(dict(metrics))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def token_counter(self):
        """Under hetrain={'loss_weighting': 'tokens'}: batch -> the tokens its loss averaged over
        (labels that are not -100; a causal LM predicts each from the one before it, so one fewer);
        None under the default sample weighting. Decided once per run, not per micro-batch."""
        if self.engine.job.config.loss_weighting != "tokens":
            return None
        base = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model   # PEFT's wrapper
        shift = 1 if type(base).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else 0   # as compute_loss tells

        def count(batch) -> int:
            labels = batch.get("labels") if isinstance(batch, dict) else None
            if labels is None:
                raise UsageError("loss_weighting='tokens' but the batch has no 'labels'",
                                 "give the dataset 'labels', or use the default loss_weighting='samples'")
            return int((labels[..., shift:] != -100).sum())

        return count

    def epoch_of(self, step, samples: int) -> float:
        """The Trainer's fractional epoch: the samples of the steps done over the dataset's length."""
        return (step.index + 1) * self.engine.job.config.global_batch / max(1, samples)

    def agreed_stop(self, engine, last: bool) -> bool:
        """A callback's should_training_stop, agreed by every rank (one may be alone in asking)."""
        flag = torch.tensor([1.0 if self.control.should_training_stop and not last else 0.0], device=engine.device)
        if dist.is_initialized() and engine.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
