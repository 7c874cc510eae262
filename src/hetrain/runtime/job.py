"""The job record: what one rank knows and holds, built by init() and prepare() (setup.py), read
by the loop (runtime/loop/stepping.py), the checkpoint glue (runtime/resilience/resume.py) and the summary (runtime/loop/summary.py).

Its fields are public on purpose: every module that needs a thing takes it from here, by name,
instead of reaching into the Engine's private attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..planning.plan import Plan
from .config import Config
from .loop.sampler import to_device
from .ranks.dist import DistContext
from .devices.faults import FaultInjector
from .devices.hooks import DeviceHooks
from .ranks.log import RankLog
from .resilience.preempt import Preemption
from .devices.precision_policy import PrecisionPolicy


@dataclass(eq=False)
class Job:
    config: Config
    ctx: DistContext
    log: RankLog
    hooks: DeviceHooks
    precision: PrecisionPolicy
    faults: FaultInjector
    emulated: object = None                  # emulate.EmulatedDevice, on an emulated device
    host: object = None                      # hardware.host.HostFacts, on an emulated device
    preemption: Preemption = None            # the stop signal, if any (made by init(), always there)
    nodes: object = None                     # ranks.nodes.JobNodes: which rank runs on which node
    # -- made by prepare() (setup.py), in this order ---------------------------------------------
    dataset: object = None
    collate: Callable | None = None
    sampler: object = None                   # data.GlobalCursorSampler
    total_steps: int = 0
    checkpointer: object = None              # checkpoint.Checkpointer, with checkpoint_dir
    plan: Plan | None = None
    layout: object = None                    # layouts/: how this rank runs a step (data, tensor, pipelined)
    profiles: tuple | None = None            # every rank's DeviceProfile, when this job measured them
    model: object = None                     # model.PreparedModel
    sync: object = None                      # DDP, or FSDP2's adapter: .no_sync() on non-last micro-batches
    guard: object = None                     # recovery.SyncGuard on DDP, when OOM recovery needs it
    optimizer: torch.optim.Optimizer | None = None
    memory_plan: object = None               # memory.MemoryPlan
    rebalancer: object = None                # rebalance.Rebalancer
    flops: object = None                     # loop.flops.FlopFacts: FLOPs per sample, every rank's peak
    recorder: object = None                  # loop.metrics.Recorder: metrics.jsonl and status lines
    extra_state: dict = field(default_factory=dict)   # register_state(): name -> obj with state_dict
    resumed: object = None                   # resume.Resumed: a resumed checkpoint's state, for register_state() after prepare()
    # -- counters the run keeps -------------------------------------------------------------------
    steps_done: int = 0
    ooms: int = 0                  # out-of-memory errors recovered on this rank
    redone_steps: int = 0          # steps redone by all ranks after an OOM in a gradient sync
    rebalances: int = 0            # share changes made by the rebalancer
    met_at: float = 0.0            # perf_counter when the ranks last met: a step's agreement, or prepare()'s end

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
        if self.emulated is not None:
            return self.emulated.label
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
        ds = self.dataset
        items = ds.__getitems__(list(indices)) if hasattr(ds, "__getitems__") else [ds[i] for i in indices]
        return to_device(self.collate(items), self.device)
