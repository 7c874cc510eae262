"""save_state / load_state of hetrain's Accelerator: hetrain's exact checkpoint of the job (model,
optimizer, schedulers, objects given to register_for_checkpointing, sampler position, RNG, plan),
in output_dir/step-N. A collective: every rank calls it, at a step boundary."""

from __future__ import annotations

from ...errors import UsageError


def save(engine, run, directory) -> str:
    check(run, "save_state", directory)
    return engine.save_state(directory)


def load(engine, run, directory) -> None:
    """Continue exactly from `directory`'s newest checkpoint: after prepare, before the training
    loader's pass (which then continues at the next sample)."""
    check(run, "load_state", directory)
    if run.started:
        raise UsageError("accelerator.load_state after training started",
                         "call load_state right after accelerator.prepare(...), before the loop")
    if not engine.load_state(directory, batch_hint="resume with the same batch_size, "
                             "gradient_accumulation_steps and number of processes"):              # (collective)
        raise UsageError(f"accelerator.load_state({directory!r}): no whole checkpoint there",
                         "pass the directory save_state wrote")
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
