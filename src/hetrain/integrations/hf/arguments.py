"""TrainingArguments read as hetrain's job: the global batch rule, the settings that map, and the
ones that conflict (one UsageError each, naming the fix; never silently changed).

The global batch. A stock Trainer on W equal GPUs takes

    per_device_train_batch_size x gradient_accumulation_steps x W

samples per optimizer step. hetrain keeps that number, so a script's learning rate, warm-up and
step counts mean what they meant, and splits it unevenly: each device takes a share in proportion
to its measured speed, in micro-batches sized to its memory. `per_device_train_batch_size` is then
the MEAN share of a device, not any one device's batch, and `gradient_accumulation_steps` only
scales the global batch (each device accumulates as many micro-batches as its share needs). Pass
`hetrain={"global_batch": N}` to name the global batch directly; it must agree with the product.

What maps, and to what:
    max_steps > 0 / num_train_epochs      max_steps / epochs
    max_grad_norm                         grad_clip (0: none)
    bf16 / fp16 / neither                 precision 'bf16' / 'fp16' / 'fp32' (hetrain={"precision": "auto"}:
                                          each device its own)
    seed (data_seed when set)             seed: hetrain's data order
    dataloader_drop_last                  drop_last
    train_sampling_strategy               'random': shuffle; 'sequential': no shuffle
    save_strategy / save_steps            Checkpoints(dir=output_dir/hetrain, every=...): hetrain's exact state
    save_total_limit                      stock's rotation of checkpoint-N, each step's hetrain state with it
    eval_strategy / eval_steps / ...      the Trainer's evaluation, each rank a part of the batches (evaluation.py)
    dataloader_num_workers                num_workers: worker processes reading each rank's micro-batches
    activation_checkpointing              Memory(activation_checkpointing='all') (False: the plan's choice)
Everything else hetrain.init takes comes through `Trainer(..., hetrain={...})`; a group there (e.g.
{"memory": {"margin": 0.2}} or Memory(margin=0.2)) sets only the fields it names, over what the
TrainingArguments decided.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields
from typing import Any

from ...errors import UsageError
from ...runtime.config import INTEGRATION_KEYWORDS, check_keywords
from ...runtime.config_groups import GROUPS, as_group

HETRAIN_STATE = "hetrain"     # the subdirectory of output_dir that holds hetrain's checkpoints
KEEP_ALL = 10**9              # Checkpoints(keep=...): the Trainer's rotation decides, not hetrain's
# hetrain={...} keys the Trainer's arguments decide (the table above): two places would be two answers.
FROM_ARGS = {"max_steps": "max_steps / num_train_epochs", "epochs": "num_train_epochs",
             "grad_clip": "max_grad_norm", "seed": "seed", "drop_last": "dataloader_drop_last",
             "shuffle": "train_sampling_strategy", "num_workers": "dataloader_num_workers", "checkpoints.dir": "output_dir",
             "checkpoints.every": "save_steps", "checkpoints.keep": "save_total_limit",
             "checkpoints.resume": "trainer.train(resume_from_checkpoint=...)"}


def _value(v):
    return getattr(v, "value", v)      # the Trainer's enums (SaveStrategy.STEPS) by their string


def conflicts(args, *, model_init) -> None:
    """The TrainingArguments hetrain's loop cannot honour: the first one found, as one UsageError
    (the flag, why, and the fix; no parenthesis left open or closed across the sentence)."""
    def refuse(flag: str, why: str, fix: str):
        raise UsageError(f"hetrain's Trainer cannot honour TrainingArguments {flag}: {why}", fix)

    if args.auto_find_batch_size:
        refuse("auto_find_batch_size=True", "hetrain sizes every device's micro-batch from its memory, and on an "
               "OOM halves it and redoes the step without changing the global batch", "remove auto_find_batch_size=True")
    if args.deepspeed or args.fsdp or getattr(args, "parallelism_config", None) is not None:
        refuse("deepspeed / fsdp / parallelism_config", "hetrain wraps the model itself, in DDP with uneven shares "
               "or in its own sharding", 'remove them and pass Trainer(..., hetrain={"sharding": "fsdp"}) to shard, '
               'or "zero1" or "capacity"')
    if _value(args.train_sampling_strategy) not in ("random", "sequential"):
        refuse(f"train_sampling_strategy={_value(args.train_sampling_strategy)!r}", "hetrain's sampler picks every "
               "step's samples from one global stream, cut unevenly by the plan",
               "use train_sampling_strategy='random' for shuffled samples, or 'sequential'")
    if _value(args.save_strategy) == "best":
        refuse("save_strategy='best'", "hetrain saves its exact state on a schedule every rank knows in advance",
               "use save_strategy='steps' or 'epoch' with load_best_model_at_end=True: the best one is kept")
    if args.batch_eval_metrics:
        refuse("batch_eval_metrics=True", "hetrain's evaluation gathers every rank's uneven part before the metrics",
               "remove batch_eval_metrics; compute_metrics then sees the whole evaluation set")
    if args.torch_compile:
        refuse("torch_compile=True", "hetrain measures and wraps the eager model", "remove torch_compile=True")
    if args.neftune_noise_alpha is not None or args.use_liger_kernel:
        refuse("neftune_noise_alpha / use_liger_kernel", "hetrain's loop does not apply them", "remove them")
    if args.push_to_hub:
        refuse("push_to_hub=True", "hetrain's Trainer saves locally", "remove push_to_hub and push output_dir afterwards")
    if model_init is not None:
        refuse("model_init=...", "hyperparameter search over mixed devices is `hetrain sweep`",
               "pass model=...; for a search, see `hetrain sweep --help`")


def global_batch(args, world_size: int, hetrain: dict) -> int:
    """per_device_train_batch_size x gradient_accumulation_steps x world size, or hetrain's
    global_batch when it agrees (the module docstring says why)."""
    product = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    given = hetrain.get("global_batch")
    if given is not None and given != product:
        raise UsageError(
            f"hetrain's Trainer: hetrain={{'global_batch': {given}}} but per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps {args.gradient_accumulation_steps} x "
            f"{world_size} device(s) = {product} samples per step (hetrain keeps the Trainer's global batch and "
            "splits it unevenly)",
            f"drop global_batch from hetrain=, or set per_device_train_batch_size x gradient_accumulation_steps to "
            f"{given} / {world_size}" + ("" if given % world_size else f" (e.g. per_device_train_batch_size="
                                          f"{given // world_size}, gradient_accumulation_steps=1)"))
    return product


def no_max_steps() -> UsageError:
    return UsageError("train_dataset is an IterableDataset without a length and max_steps is not set: its epochs' "
                      "steps cannot be counted", "set TrainingArguments(max_steps=N) (or give the dataset a __len__)")


def job_config(args, *, world_size: int, dataset_len: int | None, hetrain: dict) -> dict:
    """hetrain.init's keywords for this Trainer run (without `resume`, which train() decides).
    `dataset_len` None: a stream without a length, whose epochs cannot be counted."""
    if dataset_len is None and args.max_steps <= 0:     # as stock, which needs max_steps there too
        raise no_max_steps()
    if dataset_len is None and _value(args.save_strategy) == "epoch":
        raise UsageError("save_strategy='epoch' with a train_dataset without a length: its epochs cannot be counted",
                         "use save_strategy='steps' with save_steps=N")
    given = {name: _set_fields(name, value) for name, value in hetrain.items()}
    for name, value in given.items():
        dotted = [f"{name}.{k}" for k in value] if name in GROUPS and isinstance(value, dict) else [name]
        for key in dotted:
            if key in FROM_ARGS:
                raise UsageError(f"hetrain's Trainer: hetrain={{'{name}': ...}} sets {key}; TrainingArguments "
                                 f"decides it ({FROM_ARGS[key]})", f"remove it from hetrain= and set {FROM_ARGS[key]}")
    # an unknown key: one error (plan and sharding are init's and the layout's: trainer.py)
    check_keywords({k: v for k, v in given.items() if k not in INTEGRATION_KEYWORDS},
                   where="hetrain's Trainer (hetrain={...})")
    batch = global_batch(args, world_size, hetrain)
    config = {"global_batch": batch, "seed": args.data_seed if args.data_seed is not None else args.seed,
              "drop_last": args.dataloader_drop_last, "shuffle": _value(args.train_sampling_strategy) == "random",
              "grad_clip": args.max_grad_norm or None, "num_workers": args.dataloader_num_workers,
              "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"}
    if args.max_steps > 0:
        config["max_steps"] = args.max_steps
    else:
        config["epochs"] = float(args.num_train_epochs)
    # (activation_checkpointing: a TrainingArguments field from transformers 5.7 on)
    if getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing:
        config["memory"] = {"activation_checkpointing": "all"}
    save = _value(args.save_strategy)
    if save != "no":
        per_epoch = 0 if dataset_len is None else (dataset_len // batch) if args.dataloader_drop_last else \
            math.ceil(dataset_len / batch)
        config["checkpoints"] = {
            "dir": os.path.join(args.output_dir, HETRAIN_STATE),
            "every": max(1, per_epoch) if save == "epoch" else _save_steps(args, per_epoch),
            # hetrain keeps them all: checkpoints.py removes a step's state with its checkpoint-N,
            # by the stock Trainer's save_total_limit rule (None: every one kept)
            "keep": KEEP_ALL}
    for name, value in given.items():       # a group: field by field over what the arguments decided
        config[name] = {**config.get(name, {}), **value} if name in GROUPS and isinstance(value, dict) else value
    return config


def _set_fields(name: str, value: Any) -> Any:
    """A group given as its dataclass, as the dict of the fields it sets (those off their defaults),
    so it merges with what the TrainingArguments decided; anything else as given."""
    cls = GROUPS.get(name)
    if cls is None or isinstance(value, dict) or name == "compression" and isinstance(value, str):
        return value        # a bare compression string: check_keywords names its new form
    if not isinstance(value, cls):
        as_group(name, value)       # raises: what the group takes
    default = cls()
    return {f.name: getattr(value, f.name) for f in fields(cls) if getattr(value, f.name) != getattr(default, f.name)}


def _save_steps(args, per_epoch: int) -> int:
    steps = args.save_steps
    if 0 < steps < 1:      # a fraction of the run, as the Trainer reads it
        total = args.max_steps if args.max_steps > 0 else math.ceil(per_epoch * args.num_train_epochs)
        steps = math.ceil(total * steps)
    return max(1, int(steps))
