"""The Pipeline layout in one place: how a model is planned, cut, staged, scheduled, measured and
re-split across devices of different speeds. Bottom first (tests/unit/test_structure.py's
PIPELINE_MODULES):

    profile, stage_plan, split   pure planning (no torch): a model's blocks as the planner costs
                                 them, what a split predicts, stages sized per device. planning/
                                 imports them, so they import nothing from runtime/.
    blocks                       where a model is cut: PipelineParts, a stage's module, the blocks' profile
    stage_hooks                  what a stage asks of its device (the device's hooks answer)
    stage, move                  one metered stage of torch's pipelining; blocks moved between stages
    schedule                     Pipeline: this rank's stage of one replica, run by torch's schedule
    sizing                       the split the job runs: profiles agreed, memory and speeds per stage
    stage_state, loop            a stage's checkpoint entries; the loop object the verbs drive
    probe, block_cache           a stage's micro-batch timed as it runs; the measurement kept on disk
    resplit                      online re-splitting when a stage's speed drifts
    setup, layout                the layout's steps; PipelineSetup (one pipeline), HybridSetup (DP×PP)

Nothing is imported here, so the planner can import the pure modules without torch.
"""
