"""`hetrain plan --model-factory`'s worker: the runtime's own measurements, in the job's processes.

`hetrain plan` launches this module as `hetrain run` launches a script (launch.py: torchrun, one
process per GPU or emulated device), so every rank joins the job as hetrain.init() does and
measures what Engine.prepare measures before it plans: the same RankFacts, the same
joint_plan.measure_job (profiles, all-gather, sync and agreement probes). Rank 0 then writes the
measurements and the job's config; the CLI turns them into the Plan with the same pure
plan_from_measurements the runtime calls. No training step is taken.

    python -m hetrain.runtime.plan_only JOB.json
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

    from torch.utils.data import default_collate

    from ..errors import UsageError
    from ..files import write_json_atomic
    from . import checkpointing
    from .data import to_device
    from .engine import init
    from .factory import call_factory, load_factory
    from .joint_plan import RankFacts, measure_job
    from .precision import PrecisionPolicy
    from .probe import default_forward

    ht = init(**job["config"])          # from here on, an explained error is one line from the launcher
    cfg, spec = ht.config, job["factory"]
    model, optimizer, dataset, collate = call_factory(load_factory(spec), spec)
    collate = collate or default_collate
    model.to(ht.device)
    # As Engine.prepare: precision chosen on this rank's device and agreed by all, and blocks
    # checkpointed before measuring when the job checkpoints all of them.
    policy = PrecisionPolicy.local(cfg.precision, device=ht.device, emulated=ht.emulated, host=ht.host,
                                   allow_fallback=cfg.allow_fallback)
    policy.agree(rank=ht.rank, world_size=ht.world_size, device=ht.device, log=ht.log)
    if cfg.checkpointing == "all":
        checkpointing.checkpoint_blocks(model, cfg.checkpoint_blocks)

    def load(m: int):
        items = dataset.__getitems__(list(range(m))) if hasattr(dataset, "__getitems__") \
            else [dataset[i] for i in range(m)]
        return to_device(collate(items), ht.device)

    facts = RankFacts(rank=ht.rank, world_size=ht.world_size, device=ht.device, label=ht.device_label,
                      emulated=ht.emulated.spec if ht.emulated is not None else None,
                      compute=policy.compute, precision=policy.name, load=load, samples=len(dataset),
                      config=cfg, log=ht.log)
    measured = measure_job(facts, model, optimizer, default_forward)
    if ht.is_main:
        try:
            from ..parallel.blocks import find_parts

            blocks = len(find_parts(model).blocks)
        except UsageError:
            blocks = None                     # pipelines are not compared; --blocks can say
        write_json_atomic(job["out"], {"config": cfg.to_dict(), "measurements": measured.to_dict(),
                                       "blocks": blocks})
    ht.close()


if __name__ == "__main__":
    main(sys.argv[1:])
