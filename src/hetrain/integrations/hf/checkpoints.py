"""The Trainer's checkpoints under hetrain: `output_dir/checkpoint-N/` as the Trainer lays them out
(the model by save_pretrained, trainer_state.json), beside hetrain's exact state of the same step.

    output_dir/
      checkpoint-40/          model (config.json, model.safetensors), trainer_state.json, hetrain.json
      hetrain/step-00000040/  hetrain's: model and optimizer (torch.distributed.checkpoint, each rank
                              its own part), the sampler's cursor, the Plan, every rank's RNG, the
                              LR scheduler; what an exact resume restores

hetrain.json names the hetrain state a Trainer checkpoint belongs to (its path under output_dir).
The Trainer's own optimizer.pt / scheduler.pt / rng_state_R.pth are not written: under uneven
shares and sharding they are hetrain's state, saved once, resumable at another world size.

The stock Trainer's semantics, kept: save_total_limit=None keeps every checkpoint (stock's own
rotate_checkpoints, with the best model's protected); a second run into the same output_dir starts
afresh and replaces each checkpoint-N as it reaches N; resume_from_checkpoint may name any kept
checkpoint, of this output_dir or another. hetrain's store resumes from the newest whole checkpoint
of its directory, so each run that cannot continue an existing store (a fresh run over old
checkpoints, a resume from an older or another directory's checkpoint) gets a new store directory,
hetrain-K (the step resumed from is linked into it): no existing checkpoint is written over before
the run reaches its step, and a hetrain state no checkpoint-N names any more is removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from transformers.trainer_utils import rotate_checkpoints

from ...errors import UsageError
from ...runtime.resilience.store import checkpoint_path, checkpoint_steps
from .arguments import HETRAIN_STATE

POINTER = "hetrain.json"
TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_STORE = re.compile(rf"^{HETRAIN_STATE}(?:-(\d+))?$")


@dataclass(frozen=True)
class Resume:
    """Where this run's hetrain state goes and how it starts (decided before the job starts, from
    files alone: every rank reads the same answer before any rank writes)."""

    store: str                      # Checkpoints(dir=...)
    mode: str                       # Checkpoints(resume=...)
    checkpoint: Path | None = None  # the Trainer checkpoint resumed from (its trainer_state.json)
    link_from: Path | None = None   # hetrain state to link into the new store before prepare()
    step: int | None = None


def _trainer_checkpoints(output_dir) -> list[tuple[int, Path]]:
    root = Path(output_dir)
    return sorted((int(m.group(1)), p) for p in root.glob("checkpoint-*") if (m := _NAME.match(p.name)) and p.is_dir())


def _stores(output_dir) -> list[tuple[int, Path]]:
    root = Path(output_dir)
    return sorted((int(m.group(1) or 0), p) for p in root.glob(f"{HETRAIN_STATE}*")
                  if (m := _STORE.match(p.name)) and p.is_dir())


def _new_store(output_dir) -> Path:
    """The first store directory of output_dir that holds no checkpoint (hetrain, then hetrain-1, ...)."""
    stores = _stores(output_dir)
    for _, p in stores:
        if not checkpoint_steps(p):
            return p
    k = max((k for k, _ in stores), default=-1) + 1
    return Path(output_dir) / (HETRAIN_STATE if k == 0 else f"{HETRAIN_STATE}-{k}")


def _state_of(checkpoint: Path) -> tuple[int, Path] | None:
    try:
        pointer = json.loads((checkpoint / POINTER).read_text())
        return int(pointer["step"]), checkpoint.parent / pointer["hetrain_state"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plan(output_dir: str, resume_from_checkpoint, *, restarted: bool) -> Resume:
    """This run's store and resume mode (the module docstring says why a new store)."""
    if resume_from_checkpoint in (None, False):
        if restarted:       # `hetrain run --max-restarts`: continue the store the first attempt made
            stores = sorted((p for _, p in _stores(output_dir)), key=os.path.getmtime)     # the newest written
            return Resume(store=str(stores[-1] if stores else _new_store(output_dir)), mode="auto")
        return Resume(store=str(_new_store(output_dir)), mode="never")
    if resume_from_checkpoint is True:
        ready = [p for _, p in _trainer_checkpoints(output_dir) if _state_of(p) and _state_of(p)[1].is_dir()]
        if not ready:
            raise UsageError(f"trainer.train(resume_from_checkpoint=True) but {output_dir} holds no checkpoint "
                             "saved by hetrain's Trainer (checkpoint-N with hetrain.json and its hetrain state)",
                             "train once with save_strategy='steps' first, or call trainer.train() for a fresh run")
        path = max(ready, key=lambda p: os.path.getmtime(p / POINTER))   # the newest written, as stock's sort
    else:
        path = Path(resume_from_checkpoint)
    found = _state_of(path)
    if found is None:
        raise UsageError(f"resume_from_checkpoint={str(path)!r} is not a checkpoint of hetrain's Trainer "
                         f"(no readable {POINTER} in it)",
                         "pass a checkpoint-N directory that hetrain's Trainer wrote, or True for the newest")
    step, state = found
    if not state.is_dir():
        raise UsageError(f"resume_from_checkpoint={str(path)!r}: its hetrain state {str(state)!r} is missing",
                         "resume from another kept checkpoint-N, or copy output_dir with its hetrain* directories")
    store = state.parent
    if store.parent.resolve() == Path(output_dir).resolve() and checkpoint_steps(store)[-1:] == [step]:
        return Resume(store=str(store), mode="must", checkpoint=path, step=step)   # continue that store
    return Resume(store=str(_new_store(output_dir)), mode="must", checkpoint=path, link_from=state, step=step)


def link(resume: Resume, *, rank: int) -> None:
    """Collective, after the job started and before prepare(): rank 0 links the checkpoint resumed
    from into this run's new store (hard links; a copy across file systems)."""
    if resume.link_from is not None and rank == 0:
        target = checkpoint_path(resume.store, resume.step)
        if not target.exists():
            try:
                shutil.copytree(resume.link_from, target, copy_function=os.link)
            except OSError:
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(resume.link_from, target)
    if dist.is_initialized():
        dist.barrier()


def _named_states(output_dir) -> set[Path]:
    return {found[1].resolve() for _, p in _trainer_checkpoints(output_dir) if (found := _state_of(p))}


def write(trainer, model, step: int, store: str) -> None:
    """Collective: checkpoint-`step` in the Trainer's layout (rank 0 writes), then stock's rotation
    (save_total_limit, the best model kept); hetrain state no checkpoint names any more is removed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = None
    if any(isinstance(p, DTensor) for p in model.parameters()):     # sharded (FSDP2): every rank gathers
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    args = trainer.args
    best = trainer.state.best_global_step          # as stock's _save_checkpoint, on every rank
    if best and (best == step or (Path(args.output_dir) / f"checkpoint-{best}").exists()):
        trainer.state.best_model_checkpoint = str(Path(args.output_dir) / f"checkpoint-{best}")
    if trainer.is_world_process_zero():             # replicated: rank 0's own parameters are the model
        before = _named_states(args.output_dir)
        out = Path(args.output_dir) / f"checkpoint-{step}"
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        trainer.state.save_to_json(str(out / TRAINER_STATE))
        hetrain_state = os.path.relpath(checkpoint_path(store, step), args.output_dir)
        (out / POINTER).write_text(json.dumps({"step": step, "hetrain_state": hetrain_state}))
        rotate_checkpoints(output_dir=args.output_dir, save_total_limit=args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
        for gone in before - _named_states(args.output_dir):
            shutil.rmtree(gone, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def keep_best_only(trainer) -> None:
    """Collective, at the end: stock's save_total_limit=1 with a best model that is not the last
    checkpoint keeps the best alone (its _finalize_training); the others' hetrain state goes too."""
    args, best = trainer.args, trainer.state.best_model_checkpoint
    if args.save_total_limit == 1 and best is not None and trainer.is_world_process_zero():
        before = _named_states(args.output_dir)
        for _, path in _trainer_checkpoints(args.output_dir):
            if not os.path.samefile(path, best):
                shutil.rmtree(path, ignore_errors=True)
        for gone in before - _named_states(args.output_dir):
            shutil.rmtree(gone, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
