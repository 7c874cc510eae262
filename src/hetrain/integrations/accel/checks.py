"""What hetrain's Accelerator checks of a script's own objects, each refusal one line naming the fix
in Accelerate's own words: the Accelerator's arguments, the training DataLoader, the
dataloader_config; and how the prepared model is called (forward, autocast)."""

from __future__ import annotations

from collections.abc import Mapping

from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from ...errors import UsageError
from ...runtime.loop.stream import is_stream, stream_length
from ...runtime.user_objects import default_forward

# Accelerator(...) arguments that hand the distribution to another engine: hetrain is that engine,
# so each is refused with what to write instead (hetrain's sharding is Accelerator(hetrain={...})).
OWN_DISTRIBUTION = {
    "deepspeed_plugin": "hetrain={'sharding': 'zero1'} (ZeRO-1) or {'sharding': 'fsdp'}",
    "deepspeed_plugins": "hetrain={'sharding': 'zero1'} (ZeRO-1) or {'sharding': 'fsdp'}",
    "fsdp_plugin": "hetrain={'sharding': 'fsdp'}",
    "megatron_lm_plugin": "hetrain's data parallelism (hetrain={'sharding': 'fsdp'} for a model that does not fit)",
    "torch_tp_plugin": "hetrain's data parallelism (hetrain={'sharding': 'fsdp'} for a model that does not fit)",
    "parallelism_config": "hetrain's data parallelism (hetrain={'sharding': 'fsdp'} for a model that does not fit)",
}
PRECISIONS = {"no": "fp32", None: "fp32", "bf16": "bf16", "fp16": "fp16"}


def check_arguments(given: dict) -> None:
    """Accelerator(...)'s arguments hetrain cannot honour (given: the bound arguments)."""
    for name, instead in OWN_DISTRIBUTION.items():
        if given.get(name) is not None:
            raise UsageError(f"Accelerator({name}=...): hetrain distributes the model itself",
                             f"remove {name}= and pass Accelerator(hetrain={instead}), or run this script with "
                             "`accelerate launch` and the stock Accelerator")
    precision = given.get("mixed_precision")
    precision = getattr(precision, "value", precision)
    if precision not in PRECISIONS:
        raise UsageError(f"Accelerator(mixed_precision={precision!r}): hetrain runs 'no', 'bf16' or 'fp16'",
                         "use one of those, or Accelerator(hetrain={'precision': 'auto'}) (each device its own)")
    steps = given.get("gradient_accumulation_steps", 1)
    plugin = given.get("gradient_accumulation_plugin")
    steps = plugin.num_steps if plugin is not None else steps
    if not (isinstance(steps, int) and steps >= 1):
        raise UsageError(f"Accelerator(gradient_accumulation_steps={steps!r})", "use a whole number >= 1")
    if plugin is not None and not plugin.sync_with_dataloader:
        raise UsageError("GradientAccumulationPlugin(sync_with_dataloader=False): hetrain's steps end where the "
                         "global batches do", "remove sync_with_dataloader=False")


def check_dispatch(config, shares) -> None:
    """DataLoaderConfiguration(dispatch_batches=True): process 0 reads every batch and sends each
    process an equal slice; hetrain's ranks read their own uneven shares."""
    if config is not None and config.dispatch_batches and len(set(shares)) > 1:
        raise UsageError(f"DataLoaderConfiguration(dispatch_batches=True): process 0 would cut every batch into equal "
                         f"slices, and hetrain's plan gives the processes uneven shares {tuple(shares)}",
                         "use DataLoaderConfiguration(dispatch_batches=False) (or leave it out): each process reads "
                         "its own share")


def check_training_loader(loader: DataLoader, run_length: dict | None = None) -> tuple[bool, bool]:
    """(shuffle, drop_last) of the training DataLoader, or one UsageError for what hetrain's
    sampler cannot honour. `run_length`: the hetrain={...} keywords (max_steps, epochs)."""
    if loader.batch_size is None:
        raise UsageError("the training DataLoader has batch_sampler=... (no batch_size): hetrain forms each rank's "
                         "micro-batches from its share", "use DataLoader(dataset, batch_size=N, shuffle=...)")
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


def batch_forward(model, batch):
    """How hetrain calls the model when it measures it: model(**batch) for any mapping (a
    tokenizer's BatchEncoding too, as `model(**batch)` in an Accelerate script), else hetrain's default."""
    if isinstance(batch, Mapping):
        return model(**batch)
    return default_forward(model, batch)
