"""What a user passes as prepare(parallel=...): a layout object, checked when it is made.

    hetrain.DataParallel(sharding=None)        the whole model on every rank; sharding None: the
                                               job's `sharding` setting, else one of SHARDINGS
    hetrain.TensorParallel(split="even")       a shard of every layer on every rank: 'even' | 'speed'
    hetrain.Pipeline(stages=None, micro_batches=None, schedule="1f1b")
        stages None, or the world size: one pipeline over every device (the old 'pp');
        stages k < world size: replicas of k stages each (DP×PP, the old 'dp-pp' with stages=k);
        stages "auto": DP×PP with the stage count planned for the most throughput (the old 'dp-pp').
        micro_batches None: planned.

What can be checked without the job (a stage count of 0, an unknown schedule) raises UsageError
here; what depends on the job (more stages than devices, a pipeline without loss_fn, one device)
is checked when prepare() sees the job (runtime/layouts/choose.check). The strings 'auto', 'dp',
'pp', 'dp-pp', 'tp' and a Plan stay accepted: choose.resolve turns them into these objects.
Torch-free, so `import hetrain` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError
from .vocabulary import SCHEDULES, SHARDINGS, TP_SPLITS


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    sharding: str | None = None

    def __post_init__(self):
        if self.sharding is not None and self.sharding not in SHARDINGS:
            raise UsageError(f"DataParallel(sharding={self.sharding!r}) is not a sharding",
                             f"use one of {', '.join(SHARDINGS)}, or None for the job's sharding setting")


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    split: str = "even"

    def __post_init__(self):
        if self.split not in TP_SPLITS:
            raise UsageError(f"TensorParallel(split={self.split!r}) is not a split",
                             "use split='even' (every layer cut evenly) or split='speed' (in proportion "
                             "to each device's speed)")


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    stages: int | str | None = None
    micro_batches: int | None = None
    schedule: str = "1f1b"

    def __post_init__(self):
        s = self.stages
        if s is not None and s != "auto" and (isinstance(s, bool) or not isinstance(s, int) or s < 2):
            why = ("a pipeline needs 2 or more stages" if isinstance(s, int) and not isinstance(s, bool)
                   else "stages is a whole number of stages")
            raise UsageError(f"Pipeline(stages={s!r}): {why}",
                             "pass stages=2 or more (replicas of that many stages), stages=None (one pipeline "
                             "over every device) or stages='auto' (DP×PP, the stage count planned)")
        m = self.micro_batches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise UsageError(f"Pipeline(micro_batches={m!r}): each replica needs 1 or more micro-batches a step",
                             "pass micro_batches=1 or more (4 or more keeps the pipeline busy), or None to plan it")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"Pipeline(schedule={self.schedule!r}) is not a schedule",
                             f"use schedule= one of {', '.join(SCHEDULES)}")

    def kind_for(self, world_size: int) -> str:
        """'pp' (one pipeline over every device) or 'dp-pp' (replicas), on this many devices."""
        return "pp" if self.stages is None or self.stages == world_size else "dp-pp"


LAYOUT_TYPES = (DataParallel, TensorParallel, Pipeline)


def to_spec(layout) -> dict:
    """A layout object as plain data (a Plan's and a ranking row's record of it): its type's name and fields."""
    return {"kind": type(layout).__name__, **{k: v for k, v in vars(layout).items()}}


def from_spec(spec: dict):
    """The layout object `to_spec` recorded (UsageError for a record that names no layout)."""
    types = {t.__name__: t for t in LAYOUT_TYPES}
    fields = {k: v for k, v in spec.items() if k != "kind"}
    kind = spec.get("kind")
    if kind not in types:
        raise UsageError(f"layout record {spec!r} names no layout",
                         f"a layout record's kind is one of {', '.join(types)}")
    try:
        return types[kind](**fields)
    except TypeError as e:
        raise UsageError(f"layout record {spec!r}: {e}", f"use the fields of hetrain.{kind}") from None
