"""The job record: what one rank knows and holds, built by init() and prepare() (setup.py), read
by the loop (runtime/loop/stepping.py), the checkpoint glue (runtime/resilience/resume.py) and the summary (runtime/loop/summary.py).

Its fields are public on purpose: every module that needs a thing takes it from here, by name,
instead of reaching into the Engine's private attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..planning.plan import Plan
from .config import Config
from .user_objects import to_device
from .ranks.dist import DistContext
from .devices.faults import FaultInjector
from .devices.hooks import DeviceHooks
from .ranks.log import RankLog
from .resilience.preempt import Preemption
from .devices.precision_policy import PrecisionPolicy

if TYPE_CHECKING:     # names for the fields' types only: importing them here would be circular
    from ..hardware.host import HostFacts
    from ..planning.profile import DeviceProfile
    from .layouts.data import DataLayout
    from .loop.flops import FlopFacts
    from .loop.metrics import Recorder
    from .loop.sampler import GlobalCursorSampler
    from .memory.device_memory import MemoryPlan
    from .model import PreparedModel
    from .ranks.nodes import JobNodes
    from .resilience.oom import SyncGuard
    from .resilience.resume import Resumed
    from .resilience.store import Checkpointer


class GradientSync(Protocol):
    """What the loop asks of the module that syncs gradients (DDP, FSDP2's adapter, a sharding's)."""

    def no_sync(self) -> AbstractContextManager: ...


class Rebalancing(Protocol):
    """What the loop asks of whatever moves work between ranks when measured speeds change:
    resilience/rebalance.Rebalancer (data-parallel shares), a pipeline's stage re-split."""

    def observe(self, plan: Plan, *, busy_s: list[float], fixed_s: list[float]) -> None: ...
    def propose(self, plan: Plan, *, step: int) -> Any: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True, eq=False, init=False)
class Context:
    """What init() makes, fixed for the job: the config, the process group, this rank's device
    hooks, precision, log and faults. A change (an integration's Engine.configure) is a new one.
    What a kind of device adds (its clock, its meter) hangs off its hooks, not here."""
    config: Config
    dist: DistContext
    log: RankLog
    hooks: DeviceHooks
    precision: PrecisionPolicy
    faults: FaultInjector
    host: HostFacts | None = None            # the host CPU's facts, where the device computes on it
    preemption: Preemption | None = None     # the stop signal, if any (made by init(), always there)
    nodes: JobNodes | None = None            # which rank runs on which node

    def __init__(self, config: Config, dist: DistContext, log: RankLog, hooks: DeviceHooks,
                 precision: PrecisionPolicy, faults: FaultInjector, host: HostFacts | None = None,
                 preemption: Preemption | None = None, nodes: JobNodes | None = None):
        given = dict(config=config, dist=dist, log=log, hooks=hooks, precision=precision, faults=faults, host=host,
                     preemption=preemption, nodes=nodes)
        for name, value in given.items():
            object.__setattr__(self, name, value)

    @property
    def device(self) -> torch.device:
        return self.dist.device


@dataclass(eq=False)
class RunState:
    """The run's state, one object the loop holds (StepLoop.run): the plan in force (written by
    replan.adopt alone), the sample order, and the counters the steps keep."""
    plan: Plan | None = None
    plan_seal: tuple | None = None           # replan.seal of it: a plan changed in place is refused
    sampler: GlobalCursorSampler | None = None
    total_steps: int = 0
    steps_done: int = 0
    ooms: int = 0                  # out-of-memory errors recovered on this rank
    redone_steps: int = 0          # steps redone by all ranks after an OOM in a gradient sync
    rebalances: int = 0            # share changes made by the rebalancer
    met_at: float = 0.0            # devices/clock.host() when the ranks last met: a step's agreement, or prepare()'s end


@dataclass(eq=False)
class Job:
    context: Context
    run: RunState = field(default_factory=RunState)
    # -- made by prepare() (setup.py), in this order ---------------------------------------------
    dataset: Any = None                      # the user's map-style dataset
    collate: Callable | None = None
    reader: Any = None                       # worker processes reading micro-batches (loop/workers.py), if any
    checkpointer: Checkpointer | None = None  # with checkpoint_dir
    unmeasured: str | None = None            # why hetrain could not call the model (measure/model_call.py)
    unmeasured_facts: list | None = None     # every rank's (error, catalog speed, label, precision) from that probe
    layout: DataLayout | None = None         # layouts/: how this rank runs a step (data, tensor, pipelined)
    profiles: tuple[DeviceProfile, ...] | None = None   # every rank's, when this job measured them
    model: PreparedModel | None = None
    sync: GradientSync | None = None         # DDP, or FSDP2's adapter: .no_sync() on non-last micro-batches
    guard: SyncGuard | None = None           # on DDP, when OOM recovery needs it
    optimizer: torch.optim.Optimizer | None = None
    memory_plan: MemoryPlan | None = None
    rebalancer: Rebalancing | None = None
    flops: FlopFacts | None = None           # FLOPs per sample, every rank's peak
    recorder: Recorder | None = None         # metrics.jsonl and status lines
    extra_state: dict = field(default_factory=dict)   # register_state(): name -> obj with state_dict
    model_signature: str | None = None       # the user's model's, before any wrapping (resilience/resume.py)
    resumed: Resumed | None = None           # a resumed checkpoint's state, for register_state() after prepare()

    # -- read-only here: the context's (a new one: reconfigure) and the run state's (job.run.<name> = ...):
    # each reads the part that owns it; a property without a setter refuses `job.<name> = ...`.
    config = property(attrgetter("context.config"))                   # Config
    ctx = property(attrgetter("context.dist"))                        # DistContext
    log = property(attrgetter("context.log"))                         # RankLog
    hooks = property(attrgetter("context.hooks"))                     # DeviceHooks
    precision = property(attrgetter("context.precision"))             # PrecisionPolicy
    faults = property(attrgetter("context.faults"))                   # FaultInjector
    host = property(attrgetter("context.host"))                       # HostFacts | None
    preemption = property(attrgetter("context.preemption"))           # Preemption | None
    nodes = property(attrgetter("context.nodes"))                     # JobNodes | None
    plan = property(attrgetter("run.plan"))                           # Plan | None
    plan_seal = property(attrgetter("run.plan_seal"))                 # tuple | None
    sampler = property(attrgetter("run.sampler"))                     # GlobalCursorSampler | None
    total_steps = property(attrgetter("run.total_steps"))             # int
    steps_done = property(attrgetter("run.steps_done"))               # int
    ooms = property(attrgetter("run.ooms"))                           # int
    redone_steps = property(attrgetter("run.redone_steps"))           # int
    rebalances = property(attrgetter("run.rebalances"))               # int
    met_at = property(attrgetter("run.met_at"))                       # float

    def reconfigure(self, **changes) -> None:
        """A new context with these Config fields changed (checked as Config(...) checks them)."""
        self.context = replace(self.context, config=replace(self.context.config, **changes))

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def device_label(self) -> str:
        if (label := self.hooks.device_label()) is not None:
            return label
        if self.device.type == "cuda":
            return f"cuda:{self.device.index} {torch.cuda.get_device_name(self.device)}"
        return f"cpu (rank {self.rank})"

    @property
    def scaler(self):
        """The job-wide loss scaler, when any device runs fp16 (runtime/devices/precision_policy.py)."""
        return self.precision.scaler

    @property
    def micro_batch(self) -> int | None:
        return self.plan.devices[self.rank].micro_batch if self.plan else None

    def load(self, indices) -> object:
        """The samples at these dataset indices, collated, on this rank's device."""
        if self.collate is None:
            raise RuntimeError("Job.load() before prepare() set the collate function")
        ds = self.dataset
        items = ds.__getitems__(list(indices)) if hasattr(ds, "__getitems__") else [ds[i] for i in indices]
        return to_device(self.collate(items), self.device)

    def read(self, chunks) -> Iterator[object]:
        """Each chunk of dataset indices as `load` gives it, in order: through the worker processes
        when the job has them (Config.num_workers), else in this process."""
        if self.reader is not None:
            return self.reader.read(chunks)
        return (self.load(c) for c in chunks)
