"""One device's worker process: trials in, outcomes out.

Started by the sweep's fork server (scheduler.worker_context), never forked from the scheduler
itself: it sees only its own GPU (CUDA_VISIBLE_DEVICES set before torch is imported: on GPUs the
server holds no torch) or, on a device that is not a CUDA GPU, what its target makes of the
process (`target.enter()`, runner.SweepSetup.targets). It leaves when told (a None task) or when
the scheduler is gone: between trials, and inside one at the trial's next `ctx.compute` or
`ctx.report` (TrialContext.lifeline), so a scheduler killed alone leaves no worker training on
behind it. Its parent is the fork server, not the scheduler, so it watches a lifeline: the read end
of a pipe whose write end only the scheduler holds, at EOF once the scheduler is gone however it
died.

The storage (its SQLAlchemy engine and schema check) is made once per worker and kept across its
trials; the study objects built on it are not (below).

Each trial gets a study object of its own, synced with the storage before its Trial is built, as
Optuna's `study.ask` does: Optuna's cached storage knows only the trials it has read, so a
`suggest_*` the scheduler did not sample (a branch of a conditional space) on a trial created
since would fail, and a study kept from one trial to the next would give the sampler the history
it cached at the first. The sampler and pruner are the study's (the script's own where it gave
them), the sampler reseeded per worker as Optuna reseeds it per thread of `n_jobs`.
"""

from __future__ import annotations

import os
import queue
import time


def worker_main(index: int, setup, tasks, results, lifeline) -> None:
    """Run the trials `tasks` hands this device; put (index, number, state, value, note, busy_s,
    reports, peak bytes) on `results` for each; leave once `lifeline` (scheduler.Workers) is at EOF."""
    import logging

    from .objective import on_gpu
    from .study import parts_of, storage_of

    slot, target = setup.slots[index], setup.targets[index]
    gpu = on_gpu(target)
    if gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = target       # before torch: this GPU alone
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    if not gpu:
        target.enter()                  # the process becomes the device (as the job's ranks do)
    from .objective import TrialContext, load_objective
    from .session import DEVICE_ENV
    from .trial_run import run_trial, trial_of

    device = "cuda:0" if gpu else target.torch_device
    os.environ[DEVICE_ENV] = device     # the environment says it too (session.py)
    module = load_objective(setup.objective)
    sampler, pruner = parts_of(setup)
    if sampler is not None:
        sampler.reseed_rng()              # copies of one seeded sampler would suggest alike
    storage = storage_of(setup.url)
    while not lifeline.poll():
        try:
            task = tasks.get(timeout=0.5)
        except queue.Empty:
            continue
        if task is None:
            return
        trial_id, number, params = task
        trial, stops = trial_of(setup.study, storage, trial_id, sampler, pruner)
        ctx = TrialContext(number=number, params=params, device=device, label=slot.label, speed=slot.speed,
                           sample_s=setup.sample_s, at_speed=None if gpu else target.at_speed, trial=trial,
                           lifeline=lifeline)
        t0 = time.perf_counter()
        state, value, note, peak = run_trial(module, ctx, ctx.trial, params, setup.entry)
        results.put((index, number, state, value, note, time.perf_counter() - t0, ctx.reports, peak, bool(stops)))
