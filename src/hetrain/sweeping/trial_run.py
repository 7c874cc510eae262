"""One trial run in the process that holds its device(s): the objective called in its form, the
outcome, and the peak memory it was measured at (the need of an objective with no memory())."""

from __future__ import annotations

import os
import resource
import traceback

from .objective import Pruned, TrialContext, form_of
from .session import set_current


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PeakMemory:
    """A trial's peak: on a GPU the CUDA allocator's peak reserved bytes; on a CPU, how far the
    process's peak resident memory rose over what it held when the trial started (the peak is
    the process's, so after a bigger trial this reads high: an upper bound, never low)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.start = _rss_bytes()
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> float:
        if self.cuda:
            import torch

            return float(torch.cuda.max_memory_reserved())
        return float(max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start))


def trial_of(study_name: str, storage, trial_id: int, sampler, pruner):
    """Optuna's Trial of a trial the scheduler asked, on a study object of its own synced with the
    storage first (what `study.ask` does for the trial it creates), and the list that collects
    the objective's `trial.study.stop()` calls (the scheduler stops asking on one)."""
    import optuna

    study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
    study.get_trials(deepcopy=False)      # every trial, this one included, read into the storage's cache
    stops: list[bool] = []
    study.stop = lambda: stops.append(True)
    return optuna.trial.Trial(study, trial_id), stops


def run_trial(module, ctx: TrialContext, trial, params: dict,
              entry: str | None = None) -> tuple[str, float | None, str | None, float]:
    """(state, value, note, peak bytes) of one trial: train(params, ctx), objective(trial), or the
    function a stock script's __main__ handed to study.optimize (`entry`)."""
    import optuna

    meter = PeakMemory(ctx.device.startswith("cuda"))
    set_current(ctx)
    try:
        if form_of(module, entry) == "space/train":
            value = float(module.train(params, ctx))
        else:
            value = float(getattr(module, entry or "objective")(trial))
        outcome = ("complete", value, None)
    except (Pruned, optuna.TrialPruned) as e:
        outcome = ("pruned", None, str(e) or "pruned")
    except Exception as e:   # noqa: BLE001 — the trial failed; the sweep goes on
        outcome = ("failed", None, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        traceback.print_exc()
    finally:
        set_current(None)
    return (*outcome, meter.peak())
