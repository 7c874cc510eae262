"""Checkpoints that survive crashes: atomic, verified on load, the last K kept.

Layout of `checkpoint_dir`:
    step-00000040/            one checkpoint (a directory, renamed into place when complete)
        .metadata, *.distcp   model and optimizer, by torch.distributed.checkpoint (DCP), which
                              also reshards on load when sharding or the world size changed
        meta.pt               step, sampler cursor, Plan (+ version), RNG state of every rank,
                              loss scaler, rebalancer, the user's registered state, model signature
        manifest.json         size and sha256 of every file above, written last
    step-00000040.tmp/        a checkpoint being written (ignored, removed at the next save)

Atomic: every rank writes into the .tmp directory, then rank 0 writes the manifest, syncs, and
renames it to its final name; a crash at any point leaves the previous checkpoints intact.
On load, rank 0 checks each candidate's manifest, newest first: a truncated or corrupt checkpoint
is reported and the previous one used. The choice is broadcast, so all ranks load the same one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...errors import UsageError
from ..sharding.state import load_state_dicts, save_state_dicts, set_loaded_state

MANIFEST = "manifest.json"
META = "meta.pt"


def model_signature(model: torch.nn.Module) -> str:
    """Names, shapes and dtypes of the model's parameters and buffers, hashed."""
    h = hashlib.sha256()
    for name, t in list(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(path: Path) -> str | None:
    """None if the checkpoint at `path` is whole, else what is wrong with it."""
    manifest = path / MANIFEST
    if not manifest.exists():
        return "no manifest (it was never completed)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for name, want in files.items():
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, expected {want['bytes']} (truncated?)"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum (corrupt)"
    return None


class Checkpointer:
    def __init__(self, directory: str, *, keep: int, rank: int, log):
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank
        self.log = log
        problem = None
        if rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / f".write-test-{os.getpid()}"
                probe.write_bytes(b"ok")
                probe.unlink()
            except OSError as e:
                problem = f"checkpoint directory {str(self.dir)!r} is not writable: {e.strerror or e}"
        problem = _broadcast(problem)
        if problem:
            raise UsageError(problem, "pass a checkpoint_dir (or --run-dir) you can write to")

    def steps(self) -> list[int]:
        out = []
        for p in self.dir.glob("step-*"):
            if p.is_dir() and not p.name.endswith(".tmp"):
                try:
                    out.append(int(p.name.split("-")[1]))
                except ValueError:
                    continue
        return sorted(out)

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}"

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
             midway=None) -> Path:
        """Collective: every rank calls it with the same step. `midway()` runs between the data
        and the manifest (fault injection: a crash there must leave the old checkpoints intact)."""
        final, tmp = self.path(step), self.dir / f"step-{step:08d}.tmp"
        if self.rank == 0:
            for stale in self.dir.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        model_sd, optim_sd = save_state_dicts(model, optimizer)     # (collective under capacity sharding)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if midway is not None:
            midway()
        if self.rank == 0:
            torch.save(meta, tmp / META)
            files = {}
            for f in sorted(tmp.iterdir()):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files, "saved_at": time.time()}, indent=1))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
        dist.barrier()
        return final

    # -- load ---------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest whole checkpoint (the same on every rank), reporting any it had to skip."""
        choice = None
        if self.rank == 0:
            for step in reversed(self.steps()):
                problem = verify(self.path(step))
                if problem is None:
                    choice = str(self.path(step))
                    break
                self.log.warn_job(f"checkpoint {self.path(step).name} is unusable: {problem}; trying the previous one")
        choice = _broadcast(choice)
        return Path(choice) if choice else None

    def read_meta(self, path: Path) -> dict:
        return torch.load(path / META, weights_only=False)

    def load_model(self, path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: loads model and optimizer state in place."""
        model_sd, optim_sd = load_state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_loaded_state(model, optimizer, model_sd=state["model"], optim_sd=state["optim"])


def _broadcast(obj):
    """Rank 0's value on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rng_state() -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
