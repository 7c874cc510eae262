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
import traceback


def worker_main(index: int, setup, tasks, results, parent: int) -> None:
    """Run the trials `tasks` hands this device; put (index, number, state, value, note, busy_s,
    reports) on `results` for each."""
    import logging

    from .runner import pruner_of, storage_of

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
    from .objective import Pruned, TrialContext, load_objective

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
        try:
            value = float(module.train(params, ctx))
            outcome = ("complete", value, None)
        except (Pruned, optuna.TrialPruned) as e:
            outcome = ("pruned", None, str(e) or "pruned")
        except Exception as e:   # noqa: BLE001 — the trial failed; the sweep goes on
            outcome = ("failed", None, f"{type(e).__name__}: {e}".splitlines()[0][:300])
            traceback.print_exc()
        results.put((index, number, *outcome, time.perf_counter() - t0, ctx.reports))
