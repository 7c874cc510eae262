"""`hetrain plan --model-factory`'s worker: the runtime's own measurements, in the job's processes.

`hetrain plan` launches this module as `hetrain run` launches a script (launch.py: torchrun, one
process per device), so every rank joins the job as hetrain.init() does and
measures what prepare(parallel='auto') measures before it chooses: the same job record, the same
runtime/layouts/ranking.measure_for_ranking (profiles, sync and agreement probes, pipeline blocks, FSDP2). Rank 0 then writes the
measurements and the job's config; the CLI turns them into the Plan with the same pure
plan_from_measurements the runtime calls. No training step is taken.

    python -m hetrain.cli.plan_worker JOB.json
    JOB.json: {"factory": "script.py:make", "config": {hetrain.init keywords}, "out": "result.json"}
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    # The command's stdout is the plan (`hetrain plan --json`); what the ranks print goes to stderr.
    os.dup2(2, 1)
    with open(argv[0]) as f:
        job = json.load(f)

    from ..files import write_json_atomic
    from ..runtime.engine import init
    from ..runtime.layouts.ranking import measure_for_ranking
    from ..runtime.measure.factory import call_factory, load_factory
    from ..runtime.user_objects import default_forward
    from ..runtime.setup import prepare_to_measure

    config = job["config"]
    config["reporting"] = {**config.get("reporting", {}), "details": True}   # `hetrain plan` says every reason
    ht = init(**config)                 # from here on, an explained error is one line from the launcher
    spec = job["factory"]
    model, optimizer, dataset, collate = call_factory(load_factory(spec), spec)
    # Engine.prepare's own first steps (precision agreed by all ranks, blocks checkpointed when the
    # job checkpoints all of them), then what the ranking needs: the function parallel='auto'
    # measures with (runtime/layouts/ranking.py), so both rank the same measurements.
    prepare_to_measure(ht.job, model, optimizer, dataset, collate)
    found = measure_for_ranking(ht.job, model, optimizer, default_forward, say=ht.print, time_tp=True)
    if ht.is_main:
        if found.pipeline_parts is None and found.stack and found.blocks:
            ht.print(f"blocks: {found.blocks} {type(found.stack[1][0]).__name__} in {found.stack[0]!r} (the model's "
                     "stack of identical blocks), for comparing pipelines")
        write_json_atomic(job["out"], {"config": ht.config.to_dict(), "measurements": found.measurements.to_dict(),
                                       "blocks": found.blocks, "model": found.facts})
    ht.close()


if __name__ == "__main__":
    main(sys.argv[1:])
