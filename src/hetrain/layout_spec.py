"""What a user passes as prepare(parallel=...): a layout object, checked when it is made.

    hetrain.DataParallel(sharding=None)        the whole model on every rank; sharding None: the
                                               planner's choice (shard only when the model does not
                                               fit), else one of SHARDINGS: the one place it is set
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
                             f"use one of {', '.join(SHARDINGS)}, or None for the planner's choice (shard only when "
                             "the model does not fit)")


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

    def one_pipeline(self, world_size: int) -> bool:
        """One pipeline over every device (else replicas of `stages` stages), on this many devices."""
        return self.stages is None or self.stages == world_size

    def kind_for(self, world_size: int) -> str:
        """The Plan's `layout` word for it: 'pp' (one pipeline) or 'dp-pp' (replicas)."""
        return "pp" if self.one_pipeline(world_size) else "dp-pp"


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




def agrees(planned: dict, asked, *, world_size: int) -> bool:
    """Whether a plan recorded for `planned` runs the layout object `asked` (reconcile, as a test)."""
    try:
        reconcile(planned, asked, world_size=world_size)
    except UsageError:
        return False
    return True


def describe_spec(spec: dict) -> str:
    """A layout record as the user writes the object, with the fields it records: Pipeline(stages=2)."""
    return f"{spec.get('kind')}(" + ", ".join(f"{k}={v!r}" for k, v in spec.items() if k != "kind") + ")"


def reconcile(planned: dict, asked, *, world_size: int, asked_as: str | None = None):
    """The layout object that runs a plan recorded for `planned` (a Plan's layout record) when
    prepare() asked for `asked` (a layout object): `asked` with its open fields taken from the
    plan. A plan for another layout is refused with both named (UsageError). Pipeline's stages
    are compared as planned: one pipeline over every device is stages=None."""
    fields = {k: v for k, v in vars(asked).items()}
    if isinstance(asked, Pipeline) and fields["stages"] == world_size:
        fields["stages"] = None
    agree = planned.get("kind") == type(asked).__name__
    for key, value in planned.items():
        if key == "kind" or not agree or key not in fields:
            continue
        mine = fields[key]
        if value is None and key != "stages":    # the plan left it to the run (DataParallel's sharding)
            continue
        if isinstance(asked, Pipeline) and key == "stages" and mine == "auto":
            agree = value is not None            # 'auto' is DP×PP: replicas, not one pipeline
            fields[key] = value
        elif mine is None and key != "stages":
            fields[key] = value
        elif mine != value:
            agree = False
    if not agree:
        shown = asked_as or f"prepare(parallel={asked!r})"
        raise UsageError(f"the plan is for {describe_spec(planned)} but {shown}",
                         "drop one of them: the plan alone runs its layout; or re-plan for this layout "
                         "(`hetrain plan --out`)")
    return type(asked)(**fields)
