"""The TensorParallel layout in one place: a shard of every layer on every rank, split evenly or by
speed. Bottom first (tests/unit/test_structure.py's TENSOR_MODULES):

    split          pure planning (no torch): the TP-by-speed row, its micro-batch and communication;
                   planning/ imports it, so it imports nothing from runtime/
    styles, hf     the Megatron pairs a model has: found by structure, or the plan an HF model declares
    uneven, state  the split by speed on plain tensors; its checkpoint entries by whole-model names
    shard          tensor_parallel() and shard(): the model split, evenly (DTensor) or by speed
    probe          a step of the split by speed timed for the ranking (`hetrain plan`)
    loop           the loop object of TensorParallel (the verbs; TensorSetup is in ../data_setup.py,
                   which composes a DataSetup)

Nothing is imported here, so the planner can import the pure module without torch.
"""
