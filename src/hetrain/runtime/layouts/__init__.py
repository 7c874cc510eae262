"""How the model is spread over the devices, behind one loop: prepare(parallel=...).

    data.py            'dp': the whole model on every rank (DDP, or a sharding: runtime/sharding/)
    tensor.py          'tp': a shard of every layer on every rank, the same micro-batches
    pipelined.py       'pp', 'dp-pp': one stage of one pipeline replica; the verbs drive the schedule
    pipeline_setup.py  prepare() for the pipeline layouts
    stage_state.py     a stage's checkpoint entries, keyed by the whole model's names
    choose.py          'auto', and the checks on what was asked for

A layout gives the step loop (runtime/loop/stepping.py) the rank's pass over its micro-batches,
how the loss is computed (ht.loss), whose loss counts, what a redo resets, how gradients are
clipped, and what a checkpoint holds. Everything else — the step's agreement, the optimizer step,
loss scaling, checkpoints and resume, preemption — is the same code in every layout.
"""
