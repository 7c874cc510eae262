"""One device's worker process: trials in, outcomes out.

Spawned, not forked: it imports torch itself, sees only its own GPU (CUDA_VISIBLE_DEVICES set
before torch is imported) or, emulated, runs one thread. It leaves when told (a None task) or when
its parent, the scheduler, is gone: between trials, and inside one at the trial's next
`ctx.compute` or `ctx.report` (TrialContext.parent), so a scheduler killed alone leaves no worker
training on behind it.
"""

from __future__ import annotations

import os
import queue
import time


def worker_main(index: int, setup, tasks, results, parent: int) -> None:
    """Run the trials `tasks` hands this device; put (index, number, state, value, note, busy_s,
    reports, peak bytes) on `results` for each."""
    import logging

    from .study import pruner_of, storage_of

    slot, target = setup.slots[index], setup.targets[index]
    if target != "emulated":
        os.environ["CUDA_VISIBLE_DEVICES"] = target       # before torch: this GPU alone
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    emulated = target == "emulated"
    if emulated:
        from ..runtime.devices.emulation import become_emulated_device

        become_emulated_device()        # one CPU thread, glibc keeping freed memory, as the job's ranks
    from .objective import TrialContext, load_objective
    from .session import DEVICE_ENV
    from .trial_run import run_trial

    os.environ[DEVICE_ENV] = "cpu" if emulated else "cuda:0"     # the environment says it too (session.py)
    module = load_objective(setup.objective)
    study = optuna.load_study(study_name=setup.study, storage=storage_of(setup.url), pruner=pruner_of(setup.pruner))
    while os.getppid() == parent:
        try:
            task = tasks.get(timeout=0.5)
        except queue.Empty:
            continue
        if task is None:
            return
        trial_id, number, params = task
        ctx = TrialContext(number=number, params=params, device="cpu" if emulated else "cuda:0", label=slot.label,
                           speed=slot.speed, sample_s=setup.sample_s, emulated=emulated,
                           trial=optuna.trial.Trial(study, trial_id), parent=parent)
        t0 = time.perf_counter()
        state, value, note, peak = run_trial(module, ctx, ctx.trial, params)
        results.put((index, number, state, value, note, time.perf_counter() - t0, ctx.reports, peak))
