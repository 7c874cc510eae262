"""The Trainer's evaluation under hetrain: every rank a contiguous part of the evaluation batches,
in proportion to its share of the training batch, and the metrics of the whole set, the same on
every rank and the same as one process's.

Why this and not stock's distributed evaluation: stock gives every rank the same number of batches
(a DistributedSampler, padded by repeating samples) and gathers after each batch, so a fast and a
slow device wait on each other per batch and the repeated samples are dropped again afterwards.
Here the batches are exactly one process's (the same eval_batch_size over the same order), each
rank runs its own run of them with no collective in between, and one gather at the end puts them
back in order; compute_metrics and the loss then see what one process would have seen.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset
from transformers.trainer_pt_utils import EvalLoopContainer, find_batch_size
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from ..accel.evaluation import split


def batch_ranges(batches: int, shares: list[int]) -> list[range]:
    """Contiguous runs of batch indices, one per rank, sized by the shares (largest remainder:
    the one split of an evaluation over uneven ranks, accel/evaluation.py's)."""
    starts = np.cumsum([0] + split(batches, shares))
    return [range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def evaluation_loop(trainer, dataloader: DataLoader, *, rank: int, shares: list[int], prediction_loss_only,
                    ignore_keys, metric_key_prefix: str) -> EvalLoopOutput:
    """Stock's evaluation_loop, the batches split over the ranks (module docstring). Collective."""
    args = trainer.args
    prediction_loss_only = args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
    dataset, size = dataloader.dataset, args.eval_batch_size
    mine = batch_ranges(-(-len(dataset) // size), shares)[rank]
    indices = list(range(mine.start * size, min(mine.stop * size, len(dataset))))
    loader = DataLoader(Subset(dataset, indices), batch_size=size, collate_fn=dataloader.collate_fn,
                        num_workers=args.dataloader_num_workers if indices else 0,
                        pin_memory=args.dataloader_pin_memory)
    model = trainer.model
    model.eval()
    trainer.callback_handler.eval_dataloader = dataloader
    parts = []              # this rank's batches, in order: (losses, logits, labels)
    # Each rank counts its own batches' loss items as one process does: stock's average over the
    # ranks gathers a count per batch (ranks here run different numbers of batches) and scales the
    # loss by the ranks for DDP's mean, which no evaluation loss passes through.
    average, args.average_tokens_across_devices = args.average_tokens_across_devices, False
    try:
        for inputs in loader:
            losses, logits, labels = trainer.prediction_step(model, inputs, prediction_loss_only,
                                                             ignore_keys=ignore_keys)
            if logits is not None and trainer.preprocess_logits_for_metrics is not None:
                logits = trainer.preprocess_logits_for_metrics(logits, labels)
            # the batch's loss once per sample it holds: what stock's gather_for_metrics leaves of
            # its repeat by the batch size (the last, shorter batch's padding is dropped)
            n = find_batch_size(inputs) or size
            parts.append(_cpu((None if losses is None else losses.repeat(n), logits, labels)))
            trainer.control = trainer.callback_handler.on_prediction_step(args, trainer.state, trainer.control)
    finally:
        args.average_tokens_across_devices = average
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, parts)      # rank order is batch order: the runs are contiguous
    containers = [EvalLoopContainer(args.eval_do_concat_batches, padding_index=-100) for _ in range(3)]
    for part in (p for rank_parts in everyone for p in rank_parts):
        for container, value in zip(containers, part):
            if value is not None:
                container.add(value)
    all_losses, all_preds, all_labels = (c.get_arrays() for c in containers)
    metrics = {}
    if trainer.compute_metrics is not None and all_preds is not None and all_labels is not None:
        extra = {"losses": all_losses if "loss" in args.include_for_metrics else None}
        metrics = trainer.compute_metrics(EvalPrediction(predictions=all_preds, label_ids=all_labels, **extra))
    metrics = denumpify_detensorize(metrics)
    losses = np.concatenate(all_losses) if isinstance(all_losses, list) and all_losses else all_losses
    if isinstance(losses, np.ndarray):
        finite = np.isfinite(losses)
        if args.logging_nan_inf_filter and finite.any():
            losses = losses[finite]
        metrics[f"{metric_key_prefix}_loss"] = losses.mean().item()
    for key in list(metrics):
        if not key.startswith(f"{metric_key_prefix}_"):
            metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
    return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=len(dataset))
