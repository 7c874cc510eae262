"""One rank of a group trial (`python -m hetrain.sweeping.group_rank TASK.json`, under torchrun).

Every rank joins the group's process group (gloo on CPU devices, NCCL beside gloo on GPUs),
loads the objective and runs the trial; `hetrain.init(global_batch=...)` inside it uses that
group as it is, so the trial trains as one hetrain data-parallel job. Rank 0 alone talks to
Optuna: its `report` goes to the study and its pruning decision is broadcast, so every rank
stops at the same step (a rank never waits on a peer that left). Rank 0 writes the outcome; a
rank that fails exits at once with code 1, and torchrun stops the others.
"""

from __future__ import annotations

import base64
import datetime
import importlib
import json
import os
import sys
from types import SimpleNamespace

TIMEOUT_S = 600.0      # a collective that waits longer than this ends the trial's job


class GroupTrial:
    """What objective(trial) is handed in a group trial: rank 0's Optuna Trial, and on the other
    ranks a FixedTrial of the same parameters (placed trials' parameters are sampled before they
    run); `report` is rank 0's, `should_prune` rank 0's decision on every rank."""

    def __init__(self, base, ctx):
        self.base, self.ctx = base, ctx

    def __getattr__(self, name):
        return getattr(self.base, name)

    def report(self, value: float, step: int) -> None:
        if self.ctx.rank == 0:
            self.base.report(value, step)
        self.ctx.reports += 1

    def should_prune(self) -> bool:
        return self.ctx.agree(self.base.should_prune() if self.ctx.rank == 0 else False)


def _agree(flag: bool) -> bool:
    import torch.distributed as dist

    box = [bool(flag)]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def main(task_path: str) -> None:
    with open(task_path) as f:
        task = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if task["enter"]:                 # what makes this process its device, named by the device's target
        module, name = task["enter"].split(":")
        getattr(importlib.import_module(module), name)()
    import optuna
    import torch
    import torch.distributed as dist

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if task["device"] == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
        device = "cpu"
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        device = f"cuda:{local}"
    from .objective import TrialContext, load_objective
    from .session import DEVICE_ENV
    from .study import parts_of, storage_of
    from .trial_run import run_trial, trial_of

    os.environ[DEVICE_ENV] = device
    module = load_objective(task["objective"])
    params, number = task["params"], task["number"]
    setup = SimpleNamespace(parts=base64.b64decode(task["parts"]) if task["parts"] else None, pruner=task["pruner"])
    if rank == 0:
        sampler, pruner = parts_of(setup)
        base, _ = trial_of(task["study"], storage_of(task["url"]), task["trial_id"], sampler, pruner)
    else:
        base = optuna.trial.FixedTrial(params, number)
    ctx = TrialContext(number=number, params=params, device=device, label=task["labels"][rank],
                       speed=task["speeds"][rank], sample_s=task["sample_s"],
                       trial=base if rank == 0 else None, parent=task["parent"], rank=rank, world_size=world,
                       members=tuple(task["labels"]), sharding=task["sharding"], agree=_agree)
    state, value, note, peak = run_trial(module, ctx, GroupTrial(base, ctx), params, task["entry"])
    if rank == 0:
        tmp = task["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"state": state, "value": value, "note": note, "reports": ctx.reports, "peak": peak}, f)
        os.replace(tmp, task["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    if state == "failed":
        os._exit(1)            # its peers may wait in a collective: torchrun stops them
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
