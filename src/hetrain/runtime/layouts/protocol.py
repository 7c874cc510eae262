"""The one protocol every layout class follows (setup.prepare_job calls it without asking which
layout it is), and the protocol of the loop object a layout builds (the step loop calls it).

    Layout                 data_setup.DataSetup        DataParallel (DDP or a sharding)
                           data_setup.TensorSetup      TensorParallel (composes a DataSetup: it
                                                       shares the measuring, the split, checkpoints)
                           pipeline.layout.PipelineSetup   Pipeline(): one pipeline over every device
                           pipeline.layout.HybridSetup     Pipeline(stages=k): DP×PP replicas of k stages

A layout owns what it needs of the job (check), its plan, its build, and through its loop class
(`loop_class`: data.DataLayout, tensor.loop.TensorLayout, pipeline.loop.PipelineLayout) how ht.loss is
computed and whose loss counts, the rank's pass over its micro-batches and its checkpoint state;
`describe` is its one line for the log and for errors. A leaf: it imports no other layout module.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RankLoop(Protocol):
    """What the step loop (runtime/loop/stepping.py) asks of job.layout."""

    deferred: bool               # the user's backward() is recorded, not run (pipelines)

    def loss(self, job, mb) -> Any: ...                      # ht.loss(mb)
    def reports_loss(self, job) -> bool: ...                 # does this rank's loss count (each sample once)
    def rank_pass(self, loop, state): ...                    # this rank's micro-batches of a step
    def redo(self, job) -> None: ...                         # what a redone step resets
    def held(self, job): ...                                 # the parameters this rank holds
    def clip(self, job, max_norm: float) -> None: ...        # gradient clipping over the layout
    def states(self, job): ...                               # the checkpoint's entries (None: the default)


@runtime_checkable
class Layout(Protocol):
    """A layout object's steps in prepare(), in setup.prepare_job's order."""

    spec: Any                    # the user's layout object (layout_spec.py)
    loop_class: type             # its RankLoop: loss, the rank's pass, checkpoint state

    @property
    def blocks_compression(self) -> str | None: ...          # why gradient compression cannot run (None: it can)
    def check(self, job) -> None: ...                        # what it needs of the job, before anything is built
    def plan(self, job, model, optimizer, forward, given_plan, measured) -> float | None: ...   # job.plan; FLOPs
    def complete(self, job, model, optimizer, forward, plan) -> Any: ...   # a plan with this job's records (complete.py)
    def build(self, job, model, optimizer, forward) -> None: ...    # wrapped or staged, job.layout set
    def describe(self, job) -> str: ...                      # one line for the log and for errors
