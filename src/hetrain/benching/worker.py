"""`hetrain bench`'s worker: one configuration of the benchmark, trained in the job's processes.

`hetrain bench` launches this module as `hetrain run` launches a script (launch.py: torchrun, one
process per device), once per configuration. Every rank trains the factory's
model as a user's loop does (hetrain.init, prepare, micro-batches, backward, step); the loss is
the model output's mean, as hetrain's own measurements take it (runtime/user_objects.py), which
costs what a real loss costs next to the model. The first `warmup` steps are not timed; the
timed steps run between two barriers, so the figure is the whole job's, not one rank's. Rank 0
then writes the samples/s, the plan it ran (shares, devices) and every rank's peak memory.

    python -m hetrain.benching.worker JOB.json
    JOB.json: {"factory": "script.py:make", "config": {hetrain.init keywords}, "phase": "hetrain",
               "warmup": 2, "steps": 20, "out": "result.json"}
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable


def main(argv: list[str]) -> None:
    # The command's stdout is the benchmark's table; what the ranks print goes to stderr.
    os.dup2(2, 1)
    with open(argv[0]) as f:
        job = json.load(f)

    from ..files import write_json_atomic
    from ..report import StepProgress
    from ..runtime.engine import init
    from ..runtime.measure.factory import call_factory, load_factory
    from ..runtime.user_objects import as_scalar, default_forward

    warmup, steps = job["warmup"], job["steps"]
    ht = init(**job["config"], max_steps=warmup + steps)
    spec = job["factory"]
    model, optimizer, dataset, collate = call_factory(load_factory(spec), spec)
    model, optimizer, batches = ht.prepare(model, optimizer, dataset, collate_fn=collate)
    with StepProgress(ht, len(batches), description=f"  {job['phase']}", on=ht.is_main) as bar:
        seconds = timed_steps(ht, model, batches, warmup=warmup, on_step=bar.update,
                              loss=lambda m, batch: as_scalar(default_forward(m, batch)))
    summary = ht.summary()                    # a collective: every rank's peak memory
    if ht.is_main:
        write_json_atomic(job["out"], {
            "samples_per_s": steps * ht.config.global_batch / seconds,
            "plan": json.loads(ht.plan.to_json()),
            "devices": [d.device for d in ht.plan.devices],
            "shares": list(ht.plan.shares),
            "micro_batches": [d.micro_batch for d in ht.plan.devices],
            "peak_memory_bytes": [int(r["peak_bytes"]) for r in summary["ranks"]],
            "rebalances": summary["rebalances"],
        })
    ht.close()


def timed_steps(ht, model, batches, *, warmup: int, loss: Callable, on_step: Callable = lambda step: None) -> float:
    """Train every step of `batches` as a user's loop does, `loss(model, batch)` a micro-batch's
    mean loss; returns the seconds the steps after the first `warmup` took, timed between barriers
    on every rank (benchmarks/hetero_dp.py times its hetrain runs with it too)."""
    import torch.distributed as dist

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    started = None
    for step in batches:
        if step.index == warmup:
            barrier()                         # every rank starts the timed steps together
            started = time.perf_counter()
        for mb in step:
            with mb:
                with ht.autocast():
                    value = loss(model, mb.batch)
                ht.backward(value)
        on_step(ht.step())
    barrier()
    if started is None:
        raise ValueError(f"{warmup} warm-up steps leave none to time: the run had fewer steps")
    return time.perf_counter() - started


if __name__ == "__main__":
    main(sys.argv[1:])
