"""The Trainer's checkpoints under hetrain: `output_dir/checkpoint-N/` as the Trainer lays them out
(the model by save_pretrained, trainer_state.json), beside hetrain's exact state of the same step.

    output_dir/
      checkpoint-40/          model (config.json, model.safetensors), trainer_state.json, hetrain.json
      hetrain/step-00000040/  hetrain's: model and optimizer (torch.distributed.checkpoint, each rank
                              its own part), the sampler's cursor, the Plan, every rank's RNG, the
                              LR scheduler; what an exact resume restores

hetrain.json names the hetrain step a Trainer checkpoint belongs to. The Trainer's own optimizer.pt /
scheduler.pt / rng_state_R.pth are not written: under uneven shares and sharding they are hetrain's
state, saved once, resumable at another world size. `trainer.train(resume_from_checkpoint=...)`
resumes from hetrain's newest whole checkpoint, so the path given (or True: the newest
checkpoint-N in output_dir) must be that step; an older one is refused with the fix.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from ...errors import UsageError
from ...runtime.resilience.store import checkpoint_path, checkpoint_steps
from .arguments import HETRAIN_STATE

POINTER = "hetrain.json"
TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def _hetrain_steps(output_dir: str) -> list[int]:
    return checkpoint_steps(Path(output_dir) / HETRAIN_STATE)


def _trainer_checkpoints(output_dir: str) -> list[tuple[int, Path]]:
    root = Path(output_dir)
    found = [(int(m.group(1)), p) for p in root.glob("checkpoint-*") if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def find(output_dir: str, resume_from_checkpoint) -> tuple[int, Path] | None:
    """(step, checkpoint dir) to resume from, or None for a fresh run; checked before the job
    starts, on every rank alike (files only: every rank reads the same answer)."""
    if resume_from_checkpoint in (None, False):
        return None
    whole = set(_hetrain_steps(output_dir))
    if resume_from_checkpoint is True:
        ready = [(s, p) for s, p in _trainer_checkpoints(output_dir) if s in whole and (p / POINTER).exists()]
        if not ready:
            raise UsageError(f"trainer.train(resume_from_checkpoint=True) but {output_dir} holds no checkpoint "
                             "saved by hetrain's Trainer (checkpoint-N with hetrain.json, and hetrain/step-N)",
                             "train once with save_strategy='steps' first, or call trainer.train() for a fresh run")
        return ready[-1]
    path = Path(resume_from_checkpoint)
    if not (path / POINTER).exists():
        raise UsageError(f"resume_from_checkpoint={str(path)!r} is not a checkpoint of hetrain's Trainer "
                         f"(no {POINTER} in it)",
                         "pass a checkpoint-N directory that hetrain's Trainer wrote, or True for the newest")
    step = json.loads((path / POINTER).read_text())["step"]
    newest = max(whole) if whole else None
    if newest != step:
        raise UsageError(f"resume_from_checkpoint={str(path)!r} is step {step}, but hetrain resumes from its newest "
                         f"whole checkpoint, step {newest} (the sampler, plan and RNG of every rank are saved there)",
                         "pass resume_from_checkpoint=True (the newest), or copy output_dir and delete the newer "
                         f"hetrain/step-* directories to go back to step {step}")
    return step, Path(path)


def write(trainer, model, step: int, *, keep: int) -> None:
    """Collective: checkpoint-`step` in the Trainer's layout (rank 0 writes), keeping the newest `keep`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    state = None
    if any(isinstance(p, DTensor) for p in model.parameters()):     # sharded (FSDP2): every rank gathers
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_world_process_zero():             # replicated: rank 0's own parameters are the model
        out = Path(trainer.args.output_dir) / f"checkpoint-{step}"
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        trainer.state.save_to_json(str(out / TRAINER_STATE))
        (out / POINTER).write_text(json.dumps({"step": step, "hetrain_state": str(checkpoint_path(HETRAIN_STATE, step))}))
        for _, stale in _trainer_checkpoints(trainer.args.output_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
