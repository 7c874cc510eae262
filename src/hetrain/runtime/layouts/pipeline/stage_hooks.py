"""What a pipeline stage asks of the device it runs on (no torch at import: the planning side of
the pipeline asks it too, before any stage is built).

`StageHooks` answers for a device that times its own work and has an allocator (a GPU, a plain
CPU): a piece's time is read on the device's clock, nothing follows a piece, the allocator raises
its own out-of-memory error, the blocks run as measured, and the stages share nothing but their
links. A device that answers otherwise returns its own from its hooks (DeviceHooks.stage_hooks);
`of_job` is the job's.
"""

from __future__ import annotations

from ...devices import clock as clocks


class StageHooks:
    """A device that times its own work and has an allocator."""

    meter = None               # what counts the stage's bytes where no allocator does
    counts_bytes = False       # whether the stage counts the bytes its activations hold (for `hold`)
    blocks_on_host = False     # whether the blocks are timed on this host's CPU at speed 1 whatever the
                               # device (the same figures in every job on this CPU: worth keeping)

    def clock(self, device):
        """The clock a stage's pieces are read on: the device's own, off CUDA the host's wall clock
        (a piece holds no communication, so its wall time is its compute)."""
        return clocks.DeviceClock(device, wall=True)

    def for_probe(self) -> StageHooks:
        """The device as the pipeline probe's one-stage runs use it, with books of their own (the
        job's keep the training's)."""
        return StageHooks()

    def piece_done(self, length_s: float | None, cpu_s: float, wall_s: float) -> None:
        """After a piece of a stage ran (`wall_s` of wall time, `cpu_s` of this thread's CPU):
        `length_s` is its length where `micro_batch_s` gives one (None: its time is as measured)."""

    def micro_batch_s(self, rows: int, stage_s: float, whole_s: float) -> float | None:
        """A micro-batch of `rows` through a stage whose parts take `stage_s` a sample at speed 1
        (`whole_s`: the whole model's), where the device's time is given rather than measured;
        None: measured."""
        return None

    def hold(self, activation_bytes: int, micro_batches: int) -> None:
        """The stage holds `activation_bytes` for `micro_batches` in flight after a forward: a
        device with no allocator counts them (its peak) and raises the allocator's error past its
        memory."""

    def as_run(self, profile):
        """The blocks' costs as this device's stages run them (the split is sized from these)."""
        return profile

    def probe_host(self, time_piece, x, *, device, overhead_s: float) -> dict | None:
        """What the stages' host adds to a pipeline step, measured by the pipeline probe (a
        collective of every rank; `time_piece()` times a block's piece on a plain device, `x` a
        micro-batch of its input, `overhead_s` the schedule's own CPU a piece): the figures the
        profile keeps (PipelineProfile.host). None: the stages share no host."""
        return None

    def host_said(self, host: dict) -> str:
        """Those figures in words (the profile's source)."""
        return ""

    def shared_host(self):
        """What the stages share, as DeviceProfile.host (planning.parallelism.on_host plays a
        pipeline candidate on it); None: nothing."""
        return None

    def predicted_step(self, splits, profile, *, step_s: float, global_batch: int) -> dict:
        """The prediction's figures (Plan.predicted) where the stages' shared host lengthens the
        step of `step_s` (the slowest replica's, of `splits`); {}: it does not."""
        return {}

    def predicted_said(self, predicted: dict, *, stages: int, global_batch: int) -> str | None:
        """Those figures (from predicted_step) in one line for the log; None: nothing to say."""
        return None


def of_job(job) -> StageHooks:
    """The job's device, as its pipeline stages ask it."""
    return job.hooks.stage_hooks() or StageHooks()
