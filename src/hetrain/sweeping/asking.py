"""Asking Optuna for the next trial and what it needs, in either form of the objective file.

  space/train  space(trial) in this process gives the parameters; memory(params) the need.
  objective    Optuna's own form: the parameters are suggested inside objective(trial), in the
               worker. Once a trial has finished (complete or pruned), the search space those
               trials share (Optuna's intersection_search_space) is sampled here first, by the
               study's sampler, so the trial is placed knowing them. The values are given to the
               trial as Optuna's `enqueue_trial` gives them (its `fixed_params`): the worker's
               `suggest_*` returns them, and a parameter the objective does not suggest (a branch
               of a conditional space the finished trials happened to share) is not recorded.
               Until then nothing is known: one trial at a time runs on the largest device, and
               its measured peak is the need of later trials that have no memory(params) (the
               largest peak so far).
"""

from __future__ import annotations

from ..errors import UsageError
from ..hardware.units import format_bytes
from .groups import best_group, fits_no_group
from .objective import form_of
from .placement import Need, fits_somewhere, need_of, ranked


def presample(study, trial, space: dict, fix) -> dict:
    """Values for `space` on a trial just asked, as its sampler would suggest them (its joint
    sample where the sampler has one, else each alone), set as the trial's fixed parameters with
    `fix(params)`; values the trial was enqueued with stay."""
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    given = dict(frozen.system_attrs.get("fixed_params", {}))
    joint = trial.relative_params
    values = {}
    for name, dist in space.items():
        if name in given or dist.single():
            continue
        if name in joint and (trial.relative_search_space or {}).get(name) == dist:
            values[name] = joint[name]
        else:
            values[name] = study.sampler.sample_independent(study, frozen, name, dist)
    values.update(given)
    fix(values)
    return values


class Asker:
    def __init__(self, setup, module, study, fix=None):
        """`fix(number, params)`: sets a trial's fixed parameters in the storage (objective form)."""
        self.setup, self.module, self.study, self.fix = setup, module, study, fix
        self.form = form_of(module, setup.entry)
        self.probes: set[int] = set()           # objective-form trials asked before any had finished
        self.peak = max((t.user_attrs.get("peak_bytes") or 0.0 for t in study.get_trials(deepcopy=False)), default=0.0)

    def search_space(self) -> dict:
        from optuna.search_space import intersection_search_space
        from optuna.trial import TrialState

        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return intersection_search_space(done, include_pruned=True) if done else {}

    def known(self) -> bool:
        from optuna.trial import TrialState

        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

    def may_ask(self, queued, running) -> bool:
        """The objective form asks one trial at a time until one has finished (the first measured)."""
        return self.form == "space/train" or self.known() or not (queued or running)

    def ask(self, live):
        """(number, trial, need) of a new trial; one that fits no device and no group: UsageError."""
        from optuna.trial import TrialState

        memory = getattr(self.module, "memory", None)
        if self.form == "space/train":
            trial = self.study.ask()
            params = self.module.space(trial)
            if not isinstance(params, dict):
                raise UsageError(f"space(trial) returned {type(params).__name__}, not a dict",
                                 "return the trial's hyperparameters as a dict")
            need = need_of(memory(params) if memory else None, where=f"memory({params!r})")
        elif not self.known():
            trial, params = self.study.ask(), {}
            self.probes.add(trial.number)
            top = ranked(live)[0]
            need = Need(bytes=top.room, how="not known before a trial has finished: it runs alone on the largest "
                                            "device and is measured")
        else:
            trial = self.study.ask()
            params = presample(self.study, trial, self.search_space(), lambda p: self.fix(trial.number, p))
            if memory:
                need = need_of(memory(params), where=f"memory({params!r})")
            else:
                need = Need(bytes=self.peak, how=f"measured: {format_bytes(self.peak)}, the largest peak of a "
                                                 "finished trial")
        trial.set_user_attr("params_given", params)
        trial.set_user_attr("memory_bytes", need.bytes)
        slots = self.setup.slots
        if fits_somewhere(need, slots) is not None and best_group(need, slots) is None:
            why = fits_no_group(need, slots)
            trial.set_user_attr("reason", why)
            trial.set_user_attr("unplaced", True)        # not counted: it never ran
            self.study.tell(trial, state=TrialState.FAIL)
            raise UsageError(f"trial {trial.number} {params!r} fits no device and no group of them: {why}",
                             "narrow the search space (or memory()'s answer) to what the largest group holds, "
                             "or sweep on bigger or more devices")
        return trial.number, trial, need

    def measured(self, number: int, peak: float) -> None:
        self.peak = max(self.peak, peak)

    def need_after(self, number: int, need: Need, peak: float | None) -> Need:
        """What the table shows as a trial's need: a first trial's is what it was measured at."""
        if number in self.probes and peak is not None:
            return Need(bytes=peak, how=f"measured: {format_bytes(peak)}")
        return need

    def params_of(self, number: int, trial) -> dict:
        """The trial's parameters as the study has them (the objective form suggests in the worker)."""
        if self.form == "space/train":
            return trial.params
        return next((t.params for t in self.study.get_trials(deepcopy=False) if t.number == number), trial.params)
