"""save_state / load_state of hetrain's Accelerator: hetrain's exact checkpoint of the job (model,
optimizer, schedulers, objects given to register_for_checkpointing, sampler position, RNG, plan),
in output_dir/step-N. A collective: every rank calls it, at a step boundary."""

from __future__ import annotations

import contextlib

from ...errors import UsageError
from ...runtime.resilience import resume as persist
from ...runtime.resilience.store import Checkpointer, model_signature


def save(engine, run, directory) -> str:
    check(run, "save_state", directory)
    with store(directory, engine) as saver:
        persist.save(engine.job)
        return str(saver.path(engine.job.steps_done))


def load(engine, run, directory) -> None:
    """Continue exactly from `directory`'s newest checkpoint: after prepare, before the training
    loader's pass (which then continues at the next sample)."""
    check(run, "load_state", directory)
    if run.started:
        raise UsageError("accelerator.load_state after training started",
                         "call load_state right after accelerator.prepare(...), before the loop")
    with store(directory, engine) as loader:
        path = loader.latest()
        if path is None:
            raise UsageError(f"accelerator.load_state({directory!r}): no whole checkpoint there",
                             "pass the directory save_state wrote")
        job = engine.job
        meta = loader.read_meta(path)                                                      # (collective)
        if meta["model_signature"] != (job.model_signature or model_signature(job.model.module)):
            raise UsageError(f"checkpoint {path} was saved from a different model",
                             "load the state of a run of the same model")
        if meta["global_batch"] != job.config.global_batch:
            raise UsageError(f"checkpoint {path} was saved with global batch {meta['global_batch']}, this run "
                             f"has {job.config.global_batch}", "resume with the same batch_size, "
                             "gradient_accumulation_steps and number of processes")
        persist.restore(job, persist.Found(path, meta))                                    # (collective)
    run.restored = True


def check(run, verb: str, directory) -> None:
    if directory is None:
        raise UsageError(f"accelerator.{verb}() without a directory (hetrain's checkpoints need one)",
                         f"call {verb}('path/to/dir')")
    mb = run.plain.mb
    if run.in_step and mb is not None and mb.last:
        run.plain.keep_gradient()       # the last batch of a step without optimizer.step(): the step ends here
    if run.in_step:
        raise UsageError(f"accelerator.{verb} in the middle of a step",
                         "call it after optimizer.step() (when accelerator.sync_gradients) or between epochs")


@contextlib.contextmanager
def store(directory: str, engine):
    """hetrain's checkpoint store on `directory`, as the job's for the duration."""
    job = engine.job
    saver = Checkpointer(str(directory), keep=1 << 30, rank=job.rank, log=job.log)
    kept, job.checkpointer = job.checkpointer, saver
    try:
        yield saver
    finally:
        job.checkpointer = kept
        saver.close()
