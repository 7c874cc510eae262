"""hetrain_trainer(cls): a transformers.Trainer subclass (TRL's SFTTrainer, DPOTrainer, RewardTrainer,
or your own) with hetrain's loop inside train().

The class it makes is `(TrlLoop, hetrain's Trainer, cls)`: cls's __init__ prepares the data as it
always does (TRL tokenizes, packs, builds the reference model) and its compute_loss computes each
micro-batch's loss; hetrain's Trainer (hf/trainer.py) replaces the loop, so each rank runs its own
share in its own micro-batches and the step is agreed. TrlLoop adds what TRL needs on top:

- the loss weighting TRL's loss asks for: a loss the Trainer normalises by the tokens of the whole
  global batch (SFT: `num_items_in_batch`; `loss_is_scaled_for_ga` True, or None on a model that
  takes loss kwargs) is weighted by tokens, a per-sample mean (DPO's per pair, the reward model's)
  by samples; `hetrain={"loss_weighting": ...}` overrides it;
- TRL's metric gathers kept on their rank inside compute_loss and agreed at each log (metrics.py):
  a gather per micro-batch would hang ranks that run different numbers of them;
- the model in training mode and DPO's reference model on this rank's device, as the stock
  Trainer's train() and Accelerate's prepare would have left them.

Refused, each in one line with its fix: trainers that make their own batches inside the loop
(GRPO, RLOO, distillation: they generate in `_prepare_inputs`), KTO (its KL estimate pairs each
prompt with another sample's completion in the same batch), a subclass's own `training_step`
(hetrain's loop calls compute_loss, not training_step), `activation_offloading` (a context around
TRL's training_step), and DPO's batch-sorted losses ('aot', 'aot_unpaired').
"""

from __future__ import annotations

import transformers

from ...errors import UsageError
from ..hf.trainer import Trainer
from .metrics import agree, rank_local_gathers

# What a class defines when it makes its own batches in the loop (generation, a teacher's outputs):
# hetrain's loop takes each micro-batch from the dataset by the plan, so these would never run.
OWN_BATCHES = ("_prepare_inputs", "get_train_dataloader")
# Libraries whose training_step is known to add nothing but activation offloading (refused apart).
KNOWN_STEPS = ("trl.", "transformers.", "hetrain.")
# DPO loss types computed across the pairs of a micro-batch (they sort its log-ratios)
BATCH_SORTED = ("aot", "aot_unpaired")


class TrlLoop:
    """What a TRL trainer needs on top of hetrain's Trainer (the module docstring)."""

    def __init__(self, *args, hetrain: dict | None = None, **kwargs):
        super().__init__(*args, hetrain=hetrain, **kwargs)
        refuse_arguments(type(self).__name__, self.args)
        self.hetrain.setdefault("loss_weighting", "tokens" if self.normalised_by_tokens() else "samples")

    def normalised_by_tokens(self) -> bool:
        """Whether the stock Trainer would normalise this loss by the global batch's tokens
        (transformers' own rule for loss_is_scaled_for_ga when it counts num_items_in_batch)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool(self.model_accepts_loss_kwargs or self.compute_loss_func is not None)

    def run(self, engine, *args, **kwargs):     # hf/trainer.py's run, whatever else it is given
        self.model.train()       # the stock train() does: dropout on, and TRL logs under "train"
        ref = getattr(self, "ref_model", None)
        if ref is not None:      # DPO's frozen reference, where Accelerate would have put it
            ref.to(engine.device)
        return super().run(engine, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with rank_local_gathers(getattr(self, "accelerator", None)):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        metrics = getattr(self, "_metrics", None)      # TRL's per-micro-batch metric lists, by mode
        mode = "train" if self.model.training else "eval"   # the list TRL's log() reads
        if self.engine is not None and isinstance(metrics, dict) and mode in metrics:
            agree(metrics[mode], self.engine.device)   # (collective: every rank logs at the same steps)
        super().log(logs, start_time)


def refuse_class(trainer_cls: type) -> None:
    """The classes hetrain's loop cannot run as they mean to be run: one UsageError each."""
    name = getattr(trainer_cls, "__name__", repr(trainer_cls))
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise UsageError(f"hetrain_trainer({name}): not a transformers.Trainer subclass",
                         "pass a Trainer class such as trl.SFTTrainer; for your own loop use hetrain.init and "
                         "ht.prepare, or hetrain.integrations.accelerate.Accelerator")
    if issubclass(trainer_cls, Trainer):
        raise UsageError(f"hetrain_trainer({name}): it is hetrain's Trainer already", f"use {name} as it is")
    refuse_loop_overrides(trainer_cls)


def refuse_loop_overrides(trainer_cls: type) -> None:
    """What a Trainer subclass defines that hetrain's loop would silently bypass (its own batches,
    KTO's pairing, its own training_step): one UsageError each."""
    name = trainer_cls.__name__
    below = [c for c in trainer_cls.__mro__ if c is not transformers.Trainer and issubclass(c, transformers.Trainer)]
    own = [(c.__name__, m) for c in below for m in OWN_BATCHES if m in vars(c)]
    if own:
        raise UsageError(f"hetrain_trainer({name}): {own[0][0]} defines {own[0][1]}, so it makes its own batches "
                         "inside the Trainer's loop (generation, a teacher), which hetrain's loop replaces",
                         "use SFTTrainer, DPOTrainer or RewardTrainer, or write the loop with "
                         "hetrain.integrations.accelerate.Accelerator or ht.prepare")
    if any(c.__name__ == "KTOTrainer" and c.__module__.startswith("trl.") for c in below):
        raise UsageError(f"hetrain_trainer({name}): KTO's KL estimate pairs each prompt with another sample's "
                         "completion in the same batch, and hetrain sizes each device's micro-batches unevenly",
                         "use DPOTrainer (paired preferences) or train KTO with the stock trainer")
    stepped = [c.__name__ for c in below if "training_step" in vars(c) and not c.__module__.startswith(KNOWN_STEPS)]
    if stepped:
        raise UsageError(f"hetrain_trainer({name}): {stepped[0]} overrides training_step, which hetrain's loop "
                         "never calls (it calls compute_loss for each micro-batch, then one agreed step)",
                         "move that per-batch work into compute_loss")


class TrlSwap(TrlLoop):
    """TrlLoop over a TRL class that already stands on hetrain's Trainer (`hetrain run`'s class swap,
    integrations/swap.py): TRL's constructor does not take hetrain=, so it is set after."""

    def __init__(self, *args, hetrain: dict | None = None, **kwargs):
        super(TrlLoop, self).__init__(*args, **kwargs)
        self.hetrain.update(hetrain or {})
        refuse_arguments(type(self).__name__, self.args)
        self.hetrain.setdefault("loss_weighting", "tokens" if self.normalised_by_tokens() else "samples")


def refuse_arguments(trainer: str, args) -> None:
    """TRL arguments hetrain's loop would silently not honour: one UsageError each."""
    if getattr(args, "activation_offloading", False):
        raise UsageError(f"{trainer}: activation_offloading=True wraps TRL's training_step, which hetrain's loop "
                         "does not call", "remove activation_offloading; gradient_checkpointing=True (or "
                         "hetrain={'memory': {'activation_checkpointing': 'all'}}) saves activation memory")
    losses = getattr(args, "loss_type", None)
    losses = [losses] if isinstance(losses, str) else list(losses or ())
    sorted_ = [t for t in losses if t in BATCH_SORTED] if trainer.startswith("DPO") else []
    if sorted_:
        raise UsageError(f"{trainer}: loss_type={sorted_[0]!r} sorts the log-ratios of a micro-batch's pairs, so "
                         "its loss depends on which pairs share a micro-batch, which hetrain sizes by each device",
                         "use a per-pair loss_type such as 'sigmoid', 'ipo' or 'hinge'")


def hetrain_trainer(trainer_cls: type) -> type:
    """`trainer_cls` with hetrain's loop inside train(): same constructor, plus `hetrain={...}`."""
    refuse_class(trainer_cls)
    doc = (f"{trainer_cls.__module__}.{trainer_cls.__name__} across mixed devices: its constructor, data "
           "preparation and compute_loss, with hetrain's loop inside train() (hetrain.integrations.trl).")
    return type(trainer_cls.__name__, (TrlLoop, Trainer, trainer_cls),
                {"__doc__": doc, "__module__": "hetrain.integrations.trl", "__qualname__": trainer_cls.__name__})
