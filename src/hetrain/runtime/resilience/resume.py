"""What a job saves and restores: the glue between the job record (job.py) and Checkpointer.

Resume rules:
  * same world size: the saved Plan (shares after rebalancing, micro-batches after OOMs, its
    version) is run as it was, so the continued run computes exactly what the uninterrupted
    one would have;
  * another world size: a new Plan for the devices present, its version one past the saved one;
    the sampler's cursor is a position in the global sample stream, so not one sample is lost
    or repeated either way;
  * RNG: rank r restores the state rank r saved; a rank that did not exist keeps its fresh seed;
  * registered state (ht.register_state): an object registered before prepare() is restored in
    prepare(); one registered after it (an LR scheduler built on the optimizer prepare() returned:
    the documented way, as sharding may replace the optimizer) at its registration, from the
    found checkpoint's state that the job record keeps until then (`job.resumed`).
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from ..devices import clock as clocks
from ...errors import DoesNotFit, UsageError
from ...layout_spec import agrees, from_spec
from ...planning.plan import Plan
from . import oom as recovery
from .store import Checkpointer, gather_all, model_signature, rng_state, set_rng_state


def gather(job, obj) -> list:
    """Every rank's `obj`, in rank order (a collective)."""
    return gather_all(obj)


def save(job) -> Path:
    """Collective: a checkpoint of the whole job at the current step boundary."""
    ck: Checkpointer = job.checkpointer
    rngs = gather(job, rng_state())
    meta = {
        "step": job.steps_done,
        "sampler": job.sampler.state_dict(),
        "plan": job.plan.to_json(),
        "rebalancer": job.rebalancer.state_dict() if job.rebalancer else None,
        "scaler": job.scaler.state_dict() if job.scaler is not None else None,
        "rng": rngs,
        "extra": {name: obj.state_dict() for name, obj in job.extra_state.items()},
        "model_signature": job.model_signature or model_signature(job.model.module),   # the user's model's
        "global_batch": job.config.global_batch,
        "world_size": job.world_size,
        "layout": job.plan.describe_layout(),
    }
    path = ck.save(job.steps_done, model=job.model.module, optimizer=job.optimizer, meta=meta,
                   midway=lambda: job.faults.maybe_die(job.steps_done, "checkpoint"), states=job.layout.states(job))
    job.log.info(f"checkpoint {path.name} saved (step {job.steps_done}, plan v{job.plan.version})")
    return path


def save_in(job, directory) -> Path:
    """Collective: a whole checkpoint of the job in `directory` (not the job's checkpoint_dir)."""
    with _store(job, directory) as saver:
        save(job)
        return saver.path(job.steps_done)


def load_from(job, directory, *, batch_hint: str) -> bool:
    """Collective: continue from `directory`'s newest checkpoint; False when it holds none."""
    with _store(job, directory) as loader:
        path = loader.latest()
        if path is None:
            return False
        meta = loader.read_meta(path)                                                      # (collective)
        if meta["model_signature"] != (job.model_signature or model_signature(job.model.module)):
            raise UsageError(f"checkpoint {path} was saved from a different model",
                             "load the state of a run of the same model")
        if meta["global_batch"] != job.config.global_batch:
            raise UsageError(f"checkpoint {path} was saved with global batch {meta['global_batch']}, this run "
                             f"has {job.config.global_batch}", batch_hint)
        restore(job, Found(path, meta))                                                    # (collective)
    return True


@contextlib.contextmanager
def _store(job, directory):
    """A checkpoint store on `directory`, as the job's for the duration."""
    saver = Checkpointer(str(directory), keep=1 << 30, rank=job.rank, log=job.log)
    kept, job.checkpointer = job.checkpointer, saver
    try:
        yield saver
    finally:
        job.checkpointer = kept
        saver.close()


@dataclass(frozen=True)
class Found:
    path: Path
    meta: dict


@dataclass(frozen=True)
class Resumed:
    """What a resumed job keeps for state registered after prepare(): the checkpoint's registered
    state by name, and the optimizer's hyperparameters as the checkpoint restored them."""
    extra: dict
    groups: tuple


def find_checkpoint(job, model) -> Found | None:
    """Collective: the newest whole checkpoint, checked against this job before anything of it is
    used (a checkpoint of another model or global batch is refused, and nothing is written)."""
    cfg, ck = job.config, job.checkpointer
    # The user's model, as given: a layout may shard it into parts of other shapes (TP by speed)
    # or rename parameters (GPT-2's Conv1Ds as Linears), so save() writes this one, not the wrapped model's.
    job.model_signature = signature = model_signature(model)
    path = ck.latest()
    if path is None:
        if cfg.checkpoints.resume == "must":
            raise UsageError(f"Checkpoints(resume='must') but {ck.dir} holds no whole checkpoint",
                             "point Checkpoints(dir=...) at a run that saved checkpoints, or use resume='auto'")
        return None
    if cfg.checkpoints.resume == "never":
        raise UsageError(f"{ck.dir} already holds checkpoints (newest: {path.name}) and Checkpoints(resume='never')",
                         "use another Checkpoints(dir=...) for a fresh run, or resume='auto' to continue it")
    meta = ck.read_meta(path)    # (collective) loaded safely by rank 0, refused on every rank together
    if meta["model_signature"] != signature:
        raise UsageError(f"checkpoint {path} was saved from a different model "
                         f"(signature {meta['model_signature']}, this model {signature})",
                         "resume with the same model definition, or use a new Checkpoints(dir=...)")
    if meta["global_batch"] != cfg.global_batch:
        raise UsageError(f"checkpoint {path} was saved with global batch {meta['global_batch']}, "
                         f"this run asks for {cfg.global_batch}",
                         f"run with global_batch={meta['global_batch']}, or start a new run elsewhere")
    return Found(path, meta)


# A resume on another world size: said by default (the run's devices changed under the user), not
# only under --verbose as the plan's other notes are.
REPLANNED = "re-planned for"


def adopt_plan(job, found: Found | None) -> Plan:
    """The Plan to run: the checkpoint's own on the same world size and layout, else the fresh one
    (its version after the saved one); then the micro-batches of ranks that died of an OOM, halved.
    The gradient compression is always the fresh plan's: it follows the link this launch measured."""
    plan = job.plan
    if found is not None:
        saved = Plan.from_json(found.meta["plan"])
        same = agrees(saved.layout_record(), from_spec(plan.layout_record()), world_size=job.world_size) and \
            (saved.group, saved.stage_blocks) == (plan.group, plan.stage_blocks)
        if saved.world_size == job.world_size and same:
            plan = replace(saved, compression=plan.compression, layout_spec=plan.layout_spec, devices=tuple(
                replace(d, device=now.device) for d, now in zip(saved.devices, job.plan.devices)))
        else:
            plan = replace(job.plan, version=saved.version + 1,
                           note=f"{REPLANNED} {job.world_size} devices ({job.plan.describe_layout()}) after "
                                f"resuming from {saved.world_size} ({saved.describe_layout()})")
    return _apply_escaped_ooms(job, plan)


def restore(job, found: Found) -> None:
    """Collective: load the checkpoint's state into the prepared job."""
    meta, ck = found.meta, job.checkpointer
    ck.load_model(found.path, model=job.model.module, optimizer=job.optimizer, states=job.layout.states(job))
    job.sampler.load_state_dict(meta["sampler"])
    job.run.steps_done = meta["step"]
    if job.scaler is not None and meta["scaler"] is not None:
        job.scaler.load_state_dict(meta["scaler"])
    for name, obj in job.extra_state.items():
        if name in meta["extra"]:
            obj.load_state_dict(meta["extra"][name])
    job.resumed = Resumed(extra=dict(meta["extra"]), groups=tuple(
        {k: v for k, v in g.items() if k != "params"} for g in job.optimizer.param_groups))
    if job.rank < len(meta["rng"]):
        set_rng_state(meta["rng"][job.rank])
    if job.rebalancer is not None and meta["rebalancer"] is not None:
        job.rebalancer.load_state_dict(meta["rebalancer"])
    job.hooks.state_restored(job.layout.held(job), job.optimizer)     # a device's meter counts it from here
    saved_layout = meta.get("layout", "data parallel")
    moved = "" if saved_layout == job.plan.describe_layout() else f" (saved as {saved_layout}, resharded by name)"
    job.log.info(f"resumed from {found.path.name}{moved}: step {job.steps_done}, epoch {job.sampler.epoch}, "
                    f"sample cursor {job.sampler.cursor}, plan v{job.plan.version}"
                    + (f" (restart {job.ctx.restart})" if job.ctx.restart else ""))


def check_registered(job, given_optimizer) -> None:
    """After prepare(): refuse state registered before it that holds the optimizer prepare()
    replaced (sharding builds its own): it would drive the discarded one. Every rank decides
    alike (the same objects, the same sharding), so all raise together."""
    if job.optimizer is given_optimizer:
        return
    for name, obj in job.extra_state.items():
        if holds(obj, given_optimizer):
            raise UsageError(
                f"register_state({name!r}) before prepare() holds the optimizer that prepare() replaced "
                f"(the layout's sharding builds its own): it would drive the discarded one",
                f"build it on the optimizer prepare() returns and call ht.register_state({name!r}, ...) after prepare()")


def register(job, name: str, obj) -> None:
    """State registered after prepare(): checkpointed from now on and, if the job resumed,
    restored at once from the checkpoint (with the optimizer's hyperparameters as the checkpoint
    held them: building an LR scheduler sets the lr it finds, or moves it)."""
    job.extra_state[name] = obj
    if job.resumed is None:
        return
    if name not in job.resumed.extra:
        job.log.info(f"register_state({name!r}): the checkpoint resumed from holds no state of that name; "
                     "it starts afresh")
        return
    obj.load_state_dict(job.resumed.extra[name])
    if holds(obj, job.optimizer):
        for group, saved in zip(job.optimizer.param_groups, job.resumed.groups):
            group.update(saved)


def holds(obj, optimizer) -> bool:
    """Does `obj` (an LR scheduler, say) keep a reference to `optimizer` among its attributes?"""
    return any(v is optimizer for v in getattr(obj, "__dict__", {}).values())


def _apply_escaped_ooms(job, plan: Plan) -> Plan:
    """Halve the micro-batch of every rank whose previous attempt died of an OOM (runtime/resilience/oom.py);
    with a checkpoint or without (an OOM before the first one)."""
    import torch.distributed as dist

    found = recovery.take_escaped_ooms(str(job.checkpointer.dir), job.world_size, restart=job.ctx.restart)
    if job.world_size > 1:
        dist.barrier()   # every rank has read the records before rank 0 removes them
    if job.rank == 0:    # all of them: a stale record (another launch, a rank now gone) never reaches a later run
        recovery.clear_escaped_ooms(str(job.checkpointer.dir))
    if not found or plan.world_size != job.world_size:
        return plan
    devices = list(plan.devices)
    notes = []
    for rank, micro in sorted(found.items()):
        smaller = recovery.smaller_micro_batch(min(micro, devices[rank].micro_batch))
        if smaller is None:   # every rank read the same record: all stop here together
            raise DoesNotFit(f"rank {rank} ({devices[rank].device}) ran out of memory with a micro-batch of "
                             "1 sample in the previous attempt: the model does not fit there",
                             "hetrain.init(memory=Memory(activation_checkpointing='all')) or parallel=hetrain.DataParallel(sharding='fsdp'), "
                             "a smaller model, "
                             "or a device with more memory")
        g = plan.group    # a pipeline or TP group runs one micro-batch size: all of it shrinks
        for r in range((rank // g) * g, (rank // g + 1) * g):
            devices[r] = replace(devices[r], micro_batch=min(smaller, devices[r].micro_batch),
                                 max_micro_batch=min(smaller, devices[r].micro_batch))
        notes.append(f"rank {rank} micro-batch {micro} -> {smaller}" + (f" (and its group of {g})" if g > 1 else ""))
    note = "after an out-of-memory error ended the previous attempt: " + ", ".join(notes)
    job.log.warn_job(note)
    return plan.evolve(note=note, devices=tuple(devices))


# -- the sample log: which samples each step trained on, across restarts and world sizes --------
_attempts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # job -> its attempt's key, agreed at its first logged step


def log_samples(job, step) -> None:
    """Append this rank's samples of a finished step to its sample log (one JSON line).

    A record names its place in the step's global batch ("offset": the samples of the ranks
    before it) and its attempt: rank 0's clock at the attempt's first logged step, then the
    torchrun restart count. That key grows across restarts and across launches (a new launch
    counts restarts from 0 again), so the reader keeps, for each step, the records of its latest
    attempt, whatever world size each attempt ran at."""
    key = _attempts.get(job)
    first = key is None
    if first:   # every rank logs every step: all meet here at the same one, and take rank 0's clock
        key = _attempts[job] = list(gather(job, (clocks.wall_ns(), job.ctx.restart))[0])   # rank 0's, on every rank
    if job.rank % job.plan.group:    # one rank per pipeline or TP group writes: each sample once
        return
    directory = job.config.reporting.sample_log
    os.makedirs(directory, exist_ok=True)
    offset = job.plan.offsets()[job.rank]
    line = json.dumps({"step": step.index, "attempt": key, "offset": offset, "epochs": list(step.epochs),
                       "indices": list(step.indices)}) + "\n"
    with open(os.path.join(directory, f"rank{job.rank}.jsonl"), "a+") as f:
        if first and f.tell() > 0:   # a line a kill cut short: end it, so this one stays whole
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                line = "\n" + line
        f.write(line)


def read_sample_log(directory: str) -> dict[int, list[tuple[int, int]]]:
    """{step: [(epoch, index), ...] in global batch order}, from the latest attempt of each step
    (steps redone after a restart supersede the lost ones, at any world size). A line that is
    not a whole record (a kill mid-write) is skipped."""
    records: list[dict] = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("rank") and name.endswith(".jsonl") and name[4:-6].isdigit()):
            continue
        rank = int(name[4:-6])
        with open(os.path.join(directory, name)) as f:
            for line in f:
                rec = _record(line, rank)
                if rec is not None:
                    records.append(rec)
    latest: dict[int, tuple] = {}
    for rec in records:
        latest[rec["step"]] = max(latest.get(rec["step"], rec["attempt"]), rec["attempt"])
    steps: dict[int, list[tuple[int, int]]] = {}
    for rec in sorted(records, key=lambda r: (r["step"], r["offset"])):
        if rec["attempt"] == latest[rec["step"]]:
            steps.setdefault(rec["step"], []).extend(zip(rec["epochs"], rec["indices"]))
    return steps


def _record(line: str, rank: int) -> dict | None:
    try:
        rec = json.loads(line)
        attempt = rec["attempt"]   # written before attempt keys: the restart count alone
        rec["attempt"] = tuple(int(a) for a in attempt) if isinstance(attempt, list) else (0, int(attempt))
        rec["offset"] = rec.get("offset", rank)
        if not (isinstance(rec["step"], int) and len(rec["epochs"]) == len(rec["indices"])):
            return None
        return rec
    except (ValueError, KeyError, TypeError):
        return None
