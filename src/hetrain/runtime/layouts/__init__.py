"""How the model is spread over the devices, behind one loop: prepare(parallel=...).

The user names a layout with an object (hetrain.DataParallel, TensorParallel, Pipeline:
layout_spec.py) or a shorthand ('auto', 'dp', 'pp', 'dp-pp', 'tp', a Plan) that choose.resolve
turns into one. Each layout owns its steps:

    protocol.py        the Layout protocol (check, plan, build, describe, its loop class) and the
                       RankLoop protocol of the loop objects
    data_setup.py      DataSetup (DataParallel) and TensorSetup (TensorParallel, composing a
                       DataSetup): check, plan (measure, make the Plan), build (checkpointing,
                       wrap, sync guard, rebalancer)
    pipeline_layouts.py  PipelineSetup (one pipeline) and HybridSetup (DP×PP replicas)
    pipeline_setup.py  a pipeline's steps: measure the blocks, split, build this rank's stage,
                       the resplitter
    data.py            the loop of DataParallel: the whole model on every rank (DDP, or a sharding)
    tensor.py          the loop of TensorParallel: a shard of every layer on every rank
    pipelined.py       the loop of Pipeline: one stage of one pipeline replica; the verbs drive the schedule
    stage_state.py     a stage's checkpoint entries, keyed by the whole model's names
    checks.py          what a layout object needs of the job, checked when prepare() sees it
    choose.py          the shorthands, a plan's layout reconciled, and 'auto' (the ranking's best)
    ranking.py         what the ranking measures: the one function 'auto' and `hetrain plan` call

Each module imports only the ones below it in tests/unit/test_structure.py's LAYOUT_MODULES (protocol
and checks at the bottom, choose at the top). setup.prepare_job calls a layout's check, plan and build in the same order for every layout.
A layout's loop object gives the step loop (runtime/loop/stepping.py) the rank's pass over its
micro-batches, how the loss is computed (ht.loss), whose loss counts, what a redo resets, how
gradients are clipped, and what a checkpoint holds. Everything else — the step's agreement, the
optimizer step, loss scaling, checkpoints and resume, preemption — is the same code in every layout.
"""
