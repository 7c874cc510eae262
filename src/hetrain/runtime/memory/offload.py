"""Optimizer-state offload: a rank's optimizer state lives in host memory, as ZeRO-Offload keeps it.

On a rank whose DevicePlan says `offload_optimizer` (or under Memory(offload_optimizer='always')),
the optimizer that steps this rank's parameters is rebuilt over host copies of them (the user's
class, hyperparameters and param groups; pinned memory when the device is CUDA, so the copies run
asynchronously). Each optimizer step then

  1. copies this rank's parameters and gradients (after the gradient sync, unscaling and clipping,
     which stay on the device) into the host buffers: the parameters too, so that whatever wrote
     the device's copy since (a resume, a re-split) is what the step starts from;
  2. steps the user's optimizer class on the host: its state (exp_avg, exp_avg_sq, momentum...)
     exists only there;
  3. copies the updated parameters back into the device's.

The update is the device's own arithmetic on the same values, so training is exact (same dtype:
no master copy is made; a low-precision model steps in its own dtype, as it would on the device).
The device never holds the state: a metered device (its hooks' MemoryMeter) counts what
`held_tensors()` names, nothing here. The cost: per step, 2x the parameter bytes and the gradient
bytes over the host link, and the optimizer's arithmetic on the CPU.

Where it runs: data parallelism under sharding 'none' (the whole state), 'fsdp' and
'capacity-full' (the rank's shard of it: the local tensors of FSDP2's DTensors, or capacity-full's
slices, whose stepping optimizer `.optim` is the one replaced). Checkpoints keep their layout:
`state` is keyed by the device's parameters, and state_dict() gives DTensors back under FSDP2.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch

from ...errors import HetrainError, UsageError
from ...hardware.units import format_bytes
from ...planning.memory import state_values
from ..devices.cuda_memory import usable_bytes
from ..user_objects import optimizer_kind

OFFLOAD_SHARDINGS = ("none", "fsdp", "capacity-full")
WHERE = "hetrain.DataParallel(sharding='none' | 'fsdp' | 'capacity-full')"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2) local shard, else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def host_available_bytes() -> int | None:
    """Host memory available to new allocations: psutil's figure when it is installed, else the
    kernel's MemAvailable (/proc/meminfo); None when neither is known. Tests replace this function."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _DeviceKeyedState(Mapping):
    """The host optimizer's state, keyed by the device's parameters (what checkpoints and
    torch.distributed.checkpoint look state up by)."""

    def __init__(self, owner: HostOptimizer):
        self.owner = owner

    def __getitem__(self, param):
        return self.owner.host.state[self.owner.host_of[param]]

    def __iter__(self) -> Iterator:
        held = self.owner.host.state
        return (p for p, h in self.owner.pairs if h in held)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HostOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping on the host. `param_groups` hold the device's parameters (an
    LR scheduler, the loss scaler and gradient clipping work as usual); `host`, the same class over
    host copies, follows their hyperparameters at every step and holds all the state."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, pin: bool = False):
        from ..sharding.wrap import rebuild_optimizer

        params = [p for g in optimizer.param_groups for p in g["params"]]
        copies = {}
        for p in params:
            local = _local(p.detach())
            h = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
            copies[p] = h.copy_(local)
        self.host = rebuild_optimizer(optimizer, copies, who="optimizer offload",
                                      over="host copies of the parameters",
                                      otherwise=", or Memory(offload_optimizer='never')")
        super().__init__([dict(g) for g in optimizer.param_groups], optimizer.defaults)
        self.pairs = [(p, copies[p]) for p in params]
        self.host_of = copies
        self.pin = pin
        self.state = _DeviceKeyedState(self)

    # -- what lives where ----------------------------------------------------------------------
    def held_tensors(self) -> list[torch.Tensor]:
        """What this optimizer adds to the device's memory: nothing (the meter's protocol)."""
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        """What it holds in host memory: parameter and gradient copies, and the whole state."""
        out = [h for _, h in self.pairs] + [h.grad for _, h in self.pairs if h.grad is not None]
        for s in self.host.state.values():
            out += [v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_tensors())

    # -- the step ------------------------------------------------------------------------------
    def _groups_down(self) -> None:
        for mine, host in zip(self.param_groups, self.host.param_groups):
            host.update({k: v for k, v in mine.items() if k != "params"})   # LR schedulers change these

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UsageError("optimizer offload does not take an optimizer closure",
                             "call step() without a closure (hetrain's ht.step() does)")
        self._groups_down()
        cuda = False
        for p, h in self.pairs:
            if p.grad is None:        # torch's optimizers leave it as it is: nothing to copy either way
                h.grad = None
                continue
            local, g = _local(p.detach()), _local(p.grad)
            cuda = cuda or local.is_cuda
            h.copy_(local, non_blocking=True)
            if h.grad is None or h.grad.shape != g.shape:
                h.grad = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=self.pin)
            h.grad.copy_(g, non_blocking=True)
        if cuda:          # the device-to-host copies are asynchronous into pinned memory
            torch.cuda.current_stream().synchronize()
        self.host.step()
        for p, h in self.pairs:
            if h.grad is not None:
                _local(p.detach()).copy_(h, non_blocking=True)
        return None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self):
        """The host optimizer's state dict (positions as the device optimizer's); under FSDP2
        every element-wise value as a DTensor sharded like its parameter, as DCP saves it."""
        self._groups_down()
        sd = self.host.state_dict()
        params = [p for p, _ in self.pairs]
        for i, entry in sd["state"].items():
            p = params[i]
            if hasattr(p, "device_mesh"):
                sd["state"][i] = {k: _as_dtensor(v, p) for k, v in entry.items()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        local = {**state_dict, "state": {k: {n: (_local(v) if isinstance(v, torch.Tensor) else v)
                                             for n, v in e.items()}
                                         for k, e in state_dict["state"].items()}}
        self.host.load_state_dict(local)
        for mine, host in zip(self.param_groups, self.host.param_groups):
            mine.update({k: v for k, v in host.items() if k != "params"})


def _as_dtensor(value, param):
    if not (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == _local(param).shape):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


# -- the job's decision ------------------------------------------------------------------------
def offloading(mode: str, plan) -> tuple[bool, ...]:
    """Which ranks will keep their optimizer state on the host (before any refusal: 'never' is none)."""
    if mode == "never":
        return tuple(False for _ in plan.devices)
    return tuple(mode == "always" or d.offload_optimizer for d in plan.devices)


def options_with_offload(options, offloads: tuple[bool, ...]):
    """sharding='auto''s options (planning/memory.sharding_options) as offload runs them: only the
    shardings it runs under, without the optimizer state on the ranks that offload it."""
    if not any(offloads):
        return list(options)
    from ...planning.memory import ShardingOption

    out = []
    for o in options:
        if o.strategy not in OFFLOAD_SHARDINGS:
            continue
        states = tuple(replace(s, optimizer=0.0) if off else s for s, off in zip(o.state, offloads))
        peak = tuple(p - (s.optimizer if off else 0.0) for p, s, off in zip(o.peak, o.state, offloads))
        out.append(ShardingOption(strategy=o.strategy, state=states, peak=peak))
    return out


def decide(plan, mode: str) -> tuple[object, str]:
    """The plan with every rank's offload as it will run (recorded: same version), and why.
    Memory(offload_optimizer=mode): 'auto' follows the plan, 'always' offloads every rank, 'never'
    none, and refuses a plan that needs it (the same on every rank: the plan is)."""
    if mode == "always":
        if not all(d.offload_optimizer for d in plan.devices):
            plan = replace(plan, devices=tuple(replace(d, offload_optimizer=True) for d in plan.devices))
        return plan, "Memory(offload_optimizer='always')"
    needing = [d for d in plan.devices if d.offload_optimizer]
    if mode == "never" and needing:
        who = ", ".join(f"rank {d.rank} ({d.device})" for d in needing)
        raise UsageError(f"the plan keeps the optimizer state of {who} in host memory, but "
                         "Memory(offload_optimizer='never') forbids it",
                         "use Memory(offload_optimizer='auto') to follow the plan, or a plan without offload")
    return plan, "as the plan says"


def apply(job, optimizer: torch.optim.Optimizer, strategy: str) -> torch.optim.Optimizer:
    """prepare()'s offload step, after wrapping (a collective when any rank offloads): this rank's
    optimizer as it will step, offloaded where the plan in force says (it records the decision:
    complete.py), the host's room checked, and every offloading rank's line in the log."""
    plan, why = decide(job.plan, job.config.memory.offload_optimizer)
    if plan != job.plan:
        raise HetrainError("the plan in force does not record the optimizer offload "
                           f"Memory(offload_optimizer={job.config.memory.offload_optimizer!r}) runs",
                           "this is a bug in hetrain (the plan was not completed); please report it")
    if not any(d.offload_optimizer for d in job.plan.devices):
        return optimizer
    if strategy not in OFFLOAD_SHARDINGS:   # the layout's own: 'tp' and 'pipeline' name theirs
        from ...layout_spec import from_spec

        runs = repr(from_spec(job.plan.layout_record())) + (f" (sharding {strategy!r})" if strategy not in
                                                             ("tp", "pipeline") else "")
        raise UsageError(f"optimizer offload runs under {WHERE}; this job runs {runs}",
                         "use parallel=hetrain.DataParallel(sharding='fsdp') (or 'none', 'capacity-full'), "
                         "or Memory(offload_optimizer='never')")
    me = job.plan.devices[job.rank]
    stepping = getattr(optimizer, "optim", optimizer) if strategy == "capacity-full" else optimizer
    need = needed_bytes(stepping) if me.offload_optimizer else 0
    check_room(job, need, why)
    if not me.offload_optimizer:
        return optimizer
    offloaded = HostOptimizer(stepping, pin=job.device.type == "cuda")
    if job.memory_plan is not None:       # the device no longer holds the state it planned
        mp = job.memory_plan
        job.memory_plan = replace(mp, state=replace(mp.state, optimizer=0.0), host=float(need))
    if stepping is optimizer:
        return offloaded
    optimizer.optim = offloaded          # capacity-full: its slices' optimizer steps on the host
    return optimizer


def needed_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Host bytes this rank's offload will hold: a copy of its parameters and gradients, and the
    optimizer's values per trainable element (planning/memory.py's count; an optimizer outside
    that model is counted as Adam's two)."""
    kind = optimizer_kind(optimizer)
    values = state_values(kind) if kind else 2
    total = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            local = _local(p.detach())
            size = local.numel() * local.element_size()
            total += size * (1 + (1 + values if p.requires_grad else 0))
    return total


def check_room(job, need: int, why: str) -> None:
    """Every rank's need against its host's available memory (ranks on one host add up). A
    collective: every rank gets every figure and raises the same error, or rank 0 logs the lines."""
    import torch.distributed as dist

    me = job.plan.devices[job.rank]
    meter = job.hooks.meter
    cap = me.memory_cap_bytes or (meter.cap if meter is not None else (
        usable_bytes(job.device) if job.device.type == "cuda" else None))
    mine = {"host": socket.gethostname(), "need": need, "free": host_available_bytes(), "rank": job.rank,
            "device": me.device, "cap": cap}
    everyone = [mine]
    if job.world_size > 1:
        everyone = [None] * job.world_size
        dist.all_gather_object(everyone, mine)
    for host in dict.fromkeys(e["host"] for e in everyone):
        on = [e for e in everyone if e["host"] == host and e["need"]]
        total, free = sum(e["need"] for e in on), on[0]["free"] if on else None
        if on and free is not None and total > free:
            ranks = ", ".join(str(e["rank"]) for e in on)
            raise UsageError(
                f"optimizer offload of rank(s) {ranks} needs {format_bytes(total)} of host memory on {host}, "
                f"which has {format_bytes(free)} available",
                "free host memory, offload fewer ranks (Memory(offload_optimizer='auto') follows the plan), "
                "or Memory(offload_optimizer='never')")
    for e in everyone:
        if e["need"]:
            cap = f" {format_bytes(e['cap'])}" if e["cap"] else ""
            job.log.info(f"optimizer state of rank {e['rank']} on host: {format_bytes(e['need'])}, "
                         f"{e['device']}{cap} (parameters, gradients and state; {why})")
