"""How the model is spread over the devices, behind one loop: prepare(parallel=...).

The user names a layout with an object (hetrain.DataParallel, TensorParallel, Pipeline:
layout_spec.py) or a shorthand ('auto', 'dp', 'pp', 'dp-pp', 'tp', a Plan) that choose.resolve
turns into one. Each layout owns its steps:

    protocol.py        the Layout protocol (check, plan, build, describe, its loop class) and the
                       RankLoop protocol of the loop objects
    data_setup.py      DataSetup (DataParallel) and TensorSetup (TensorParallel, composing a
                       DataSetup): check, plan (measure, make the Plan), build (checkpointing,
                       wrap, sync guard, rebalancer)
    pipeline/          the Pipeline layout, whole: its pure planning (profile, stage_plan, split:
                       no torch, the planner imports them), where a model is cut (blocks), a stage
                       and the schedule (stage, schedule), stage sizing and block moves (sizing,
                       move), the stage probe and its cache (probe, block_cache), online
                       re-splitting (resplit), the steps (setup), PipelineSetup and HybridSetup
                       (layout), its loop object (loop) and a stage's checkpoint entries (stage_state)
    data.py            the loop of DataParallel: the whole model on every rank (DDP, or a sharding)
    tensor/            the TensorParallel layout: its pure planning (split), the Megatron pairs
                       (styles, hf), the split by speed (uneven, state), shard, probe, and its loop
                       object (loop): a shard of every layer on every rank
    checks.py          what a layout object needs of the job, checked when prepare() sees it
    choose.py          the shorthands, a plan's layout reconciled, and 'auto' (the ranking's best)
    ranking.py         what the ranking measures: the one function 'auto' and `hetrain plan` call

Each module imports only the ones below it in tests/unit/test_structure.py's LAYOUT_MODULES (protocol
and checks at the bottom, choose at the top; PIPELINE_MODULES and TENSOR_MODULES order the two packages). setup.prepare_job calls a layout's check, plan and build in the same order for every layout.
A layout's loop object gives the step loop (runtime/loop/stepping.py) the rank's pass over its
micro-batches, how the loss is computed (ht.loss), whose loss counts, what a redo resets, how
gradients are clipped, and what a checkpoint holds. Everything else — the step's agreement, the
optimizer step, loss scaling, checkpoints and resume, preemption — is the same code in every layout.
"""
