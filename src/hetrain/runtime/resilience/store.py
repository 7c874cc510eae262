"""Checkpoints that survive crashes: atomic, verified on load, the last K whole ones kept.

Layout of `checkpoint_dir`:
    .hetrain-checkpoints.lock  held by rank 0 for the Engine's life: one job per directory
    step-00000040/            one checkpoint (a directory, renamed into place when complete)
        .metadata, *.distcp   model and optimizer, by torch.distributed.checkpoint (DCP), which
                              also reshards on load when sharding or the world size changed
        meta.pt               step, sampler cursor, Plan (+ version), RNG state of every rank,
                              loss scaler, rebalancer, the user's registered state, model signature
        manifest.json         format, size and sha256 of every file above, written last
    step-00000040.tmp/        a checkpoint being written (ignored, removed at the next save)

Atomic: every rank writes into the .tmp directory and hashes the files it wrote (rank 0 also
.metadata and meta.pt); rank 0 writes the manifest from the gathered hashes, syncs, and renames
it to its final name; a crash at any point leaves the previous checkpoints intact. On load the
candidates are tried newest first: rank 0 reads the manifest (manifest.py: a malformed one is
reported and the previous checkpoint tried), each rank checks its share of the files, and the
gathered answers decide, the same on every rank. No rank reads the whole checkpoint while its
peers wait in a collective bounded by timeout_s.

Retention counts only checkpoints known whole (the one latest() verified, the ones this job
wrote): unusable newer directories never push the one resumed from, or the one just written,
out of the last K.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..devices import clock as clocks
from ...errors import HetrainError, UsageError
from ..sharding.state import load_state_dicts, save_state_dicts, set_loaded_state
from . import manifest as mf
from .lock import CHECKPOINT_LOCK, try_lock
from .manifest import FORMAT, KIND, MANIFEST, META, Refused
from .safe_meta import load_meta


def dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is first written or read: a job
    that never checkpoints does not pay its import (tests/unit/test_lazy_torch.py)."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def model_signature(model: torch.nn.Module) -> str:
    """Names, shapes and dtypes of the model's parameters and buffers, hashed."""
    h = hashlib.sha256()
    for name, t in list(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_share(directory: Path, rank: int, world_size: int) -> dict | str:
    """{name: {"bytes", "sha256"}} of this rank's share of the files in `directory` (each synced
    to disk first), or what went wrong. Never raises: the peers wait for every rank's answer."""
    names = [p.name for p in directory.iterdir() if p.name != MANIFEST] if directory.is_dir() else []
    return hash_files(directory, mf.share(names, rank, world_size), rank)


def hash_files(directory: Path, names, rank: int) -> dict | str:
    try:
        out = {}
        for name in names:
            f = directory / name
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            out[name] = {"bytes": f.stat().st_size, "sha256": mf.sha256(f)}
        return out
    except Exception as e:   # noqa: BLE001
        return f"rank {rank} could not hash its checkpoint files in {directory}: {getattr(e, 'strerror', None) or e}"


def checkpoint_steps(directory: str | Path) -> list[int]:
    """The steps of the checkpoint directories under `directory` (whole or not: latest() checks),
    oldest first; one still being written (.tmp) is not one."""
    out = []
    for p in Path(directory).glob("step-*"):
        if p.is_dir() and not p.name.endswith(".tmp"):
            try:
                out.append(int(p.name.split("-")[1]))
            except ValueError:
                continue
    return sorted(out)


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


class Checkpointer:
    def __init__(self, directory: str, *, keep: int, rank: int, log):
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank
        self.log = log
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.whole: set[int] = set()   # steps known whole: verified by latest(), or written by this job
        self._lock = None
        problem = None
        if rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._lock, held_by = try_lock(self.dir, CHECKPOINT_LOCK)
                if held_by is not None:
                    problem = ("in use", f"checkpoint directory {str(self.dir)!r} is in use by another "
                                         f"hetrain job: {held_by}")
            except OSError as e:
                problem = ("unwritable", f"checkpoint directory {str(self.dir)!r} is not writable: {e.strerror or e}")
        problem = _broadcast(problem)
        if problem:
            kind, what = problem
            raise UsageError(what, "wait for that job to finish, or give this one another Checkpoints(dir=...)"
                             if kind == "in use" else "pass a Checkpoints(dir=...) (or --run-dir) you can write to")

    def close(self) -> None:
        """Let another job use the directory (the kernel does it too if this process dies)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def steps(self) -> list[int]:
        return checkpoint_steps(self.dir)

    def path(self, step: int) -> Path:
        return checkpoint_path(self.dir, step)

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
             midway=None, states=None) -> Path:
        """Collective: every rank calls it with the same step. `midway()` runs between the data
        and the manifest (fault injection: a crash there must leave the old checkpoints intact).
        `states`: the layout's state dicts (runtime/layouts/pipeline/stage_state.py; default: the model and
        optimizer under data parallelism, runtime/sharding/state.py)."""
        final, tmp = self.path(step), self.dir / f"step-{step:08d}.tmp"
        if self.rank == 0:
            for stale in self.dir.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        model_sd, optim_sd = (states.save_dicts() if states is not None          # (collective under capacity
                              else save_state_dicts(model, optimizer))           #  sharding)
        dcp().save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if midway is not None:
            midway()
        mine = None
        if self.rank == 0:
            try:
                torch.save({**meta, "format": FORMAT}, tmp / META)
            except Exception as e:   # noqa: BLE001  (said on every rank below, not raised here alone)
                mine = f"rank 0 could not write {META}: {e}"
        shares = gather_all(mine or hash_share(tmp, self.rank, self.world_size))   # (collective) each its own files
        failed = [s for s in shares if isinstance(s, str)]
        if failed:   # every rank has the same list: all stop here together
            raise HetrainError(f"checkpoint {final.name} was not saved: {failed[0]}",
                               "check the checkpoint directory's disk (space, permissions)")
        outcome = self._complete(step, tmp, shares) if self.rank == 0 else None
        outcome = _broadcast(outcome)    # (collective) also what tells the peers the checkpoint is in place
        if outcome is not None:
            raise HetrainError(f"checkpoint {final.name} was not saved: {outcome}",
                               "check the checkpoint directory's disk (space, permissions)")
        return final

    def _complete(self, step: int, tmp: Path, shares: list[dict]) -> str | None:
        """Rank 0: the manifest from every rank's hashes, then the rename into place and retention.
        Returns what went wrong, for every rank to raise together, or None."""
        final = self.path(step)
        try:
            files = {name: entry for s in shares for name, entry in s.items()}
            late = hash_files(tmp, [f.name for f in tmp.iterdir() if f.name not in files and f.name != MANIFEST], 0)
            if isinstance(late, str):
                return late
            files.update(late)   # a file no rank saw when it listed the directory (none, normally)
            mf.write_manifest(tmp, {"format": FORMAT, "kind": KIND, "step": step, "files": files,
                                    "saved_at": clocks.wall()})
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            self.whole.add(step)
            self._retain()
        except OSError as e:
            return f"rank 0 could not complete it: {e.strerror or e}"
        return None

    def _retain(self) -> None:
        """Keep the newest `keep` checkpoints known whole; remove older known-whole ones and any
        unverified directory older than all of those. Unverified newer ones stay (they are
        reported, and skipped, at every resume)."""
        present = set(self.steps())
        known = sorted(self.whole & present)
        kept = known[-self.keep:]
        if not kept:
            return
        for old in sorted(present - set(kept)):
            if old in self.whole or old < kept[0]:
                shutil.rmtree(self.path(old), ignore_errors=True)
                self.whole.discard(old)

    # -- load ---------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """Collective: the newest whole checkpoint (the same on every rank), reporting any it had
        to skip. Rank 0 reads each candidate's manifest; every rank checks its share of the files."""
        for step in _broadcast(self.steps()[::-1] if self.rank == 0 else None):   # newest first
            path = self.path(step)
            files = _broadcast(mf.read(path, step) if self.rank == 0 else None)
            if isinstance(files, Refused):
                raise UsageError(f"{path}: {files.what}", files.fix)
            problem = files if isinstance(files, str) else next(
                (p for p in gather_all(mf.check(path, {n: files[n] for n in mf.share(files, self.rank, self.world_size)}))
                 if p is not None), None)
            if problem is None:
                self.whole.add(step)
                return path
            self.log.warn_job(f"checkpoint {path.name} is unusable: {problem}; trying the previous one")
        return None

    def read_meta(self, path: Path) -> dict:
        """Collective: the checkpoint's meta.pt, loaded by rank 0 without running any code in it
        (safe_meta.py), and the same on every rank; a refusal is raised on every rank."""
        out = _broadcast(load_meta(path / META, step=int(path.name.split("-")[1])) if self.rank == 0 else None)
        if isinstance(out, Refused):
            raise UsageError(f"{path / META}: {out.what}", out.fix)
        return out

    def load_model(self, path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   states=None) -> None:
        """Collective: loads model and optimizer state in place (DCP reshards: any layout's entries,
        keyed by the whole model's names, land where this job holds them)."""
        model_sd, optim_sd = states.load_dicts() if states is not None else load_state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp().load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:   # noqa: BLE001  DCP's is a BaseException
            # every rank asks for its own entries and DCP gathers every rank's failure: all raise this
            raise UsageError(f"checkpoint {path.name} cannot be loaded into this job's layout: {_last_line(e)}",
                             "resume with the model and optimizer it was saved from, or start a new "
                             "Checkpoints(dir=...)") from None
        if states is not None:
            states.set_loaded(state["model"], state["optim"])
        else:
            set_loaded_state(model, optimizer, model_sd=state["model"], optim_sd=state["optim"])


def _last_line(error: BaseException) -> str:
    """The line of DCP's per-rank report that says what was wrong ('Missing key ...')."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip() and not ln.startswith(" ")]
    said = [ln for ln in lines if "Error" in ln.split(":")[0]] or lines or [type(error).__name__]
    return said[-1][:300]


def _broadcast(obj):
    """Rank 0's value on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_all(obj) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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
