"""Memory per device: what the plan expects, what was measured, and the report at the end.

Planned = model state under this rank's sharding (planning/memory.py's model, from the real
parameter counts — gradients and optimizer state for the requires_grad ones only —, dtypes and
optimizer) + activations of its planned micro-batch, measured on two
real samples after checkpointing is applied and under this rank's autocast. Measured = the CUDA
allocator's peak, or the bytes the device hooks' meter counted where the device has one
(parameters, gradients, optimizer state, FSDP2's unsharded units and saved activations). A plain
CPU process has neither: nothing measured there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...hardware.units import format_bytes
from ...planning.memory import (DeviceMemory, StateBytes, choose_sharding, sharding_options,
                               state_bytes)
from ..ranks import agree
from ..ranks.torch_compat import fsdp_redoes_a_broken_step
from ..sharding import wrap as sharding
from ..devices.cuda_memory import usable_bytes
from ..devices.saved_bytes import SavedBytes
from ..user_objects import as_scalar, default_forward, optimizer_kind


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """This rank's planned peak, in parts."""

    strategy: str
    state: StateBytes
    micro_batch: int
    activation_per_sample: float | None    # measured after checkpointing; None: not measured
    activation_fixed: float = 0.0          # activation bytes that do not grow with the batch
    checkpointing: bool
    note: str = ""
    host: float = 0.0                      # optimizer offload: bytes held in host memory instead (offload.py)

    @property
    def activations(self) -> float | None:
        if self.activation_per_sample is None:
            return None
        return self.activation_fixed + self.activation_per_sample * self.micro_batch

    @property
    def total(self) -> float:
        return self.state.total + (self.activations or 0.0)


def saved_activation_bytes(model, batch, *, forward=default_forward, device, autocast) -> float:
    """Bytes one forward saves for backward, parameters excluded (a Linear saves its weight: that
    is model state, already counted), as the CUDA allocator or the meter sees them. RNG restored,
    gradients cleared."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        meter = SavedBytes(model)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with meter.forward(), autocast():
            loss = as_scalar(forward(model, batch))
        saved = float(meter.activations)
        fresh = [p for p in model.parameters() if p.requires_grad and p.grad is None]
        loss.backward()
        if cuda:
            # The backward's peak holds the gradients it allocated: model state (counted there),
            # not activations.
            torch.cuda.synchronize(device)
            grads = sum(p.grad.numel() * p.grad.element_size() for p in fresh if p.grad is not None)
            saved = max(saved, float(torch.cuda.max_memory_allocated(device) - base - grads))
        model.zero_grad(set_to_none=True)
    return saved


def measure_activations(load, *, model, forward, device, autocast, n_max: int) -> tuple[float, float]:
    """Saved-activation bytes of `model` as it will run (checkpointing, autocast), as
    (fixed, per sample): measured on 1 and 2 samples, since some saved tensors (position
    embeddings, masks) do not grow with the batch and one sample alone would overstate the rest."""
    def bytes_for(n):
        return saved_activation_bytes(model, load(range(n)), forward=forward, device=device, autocast=autocast)
    lo = 1
    try:
        at_lo = bytes_for(1)
    except ValueError:       # a model that cannot train on one sample (BatchNorm): 2 and 4
        lo = 2
        at_lo = bytes_for(2)
    if n_max < 2 * lo:
        return 0.0, at_lo / lo
    per = max((bytes_for(2 * lo) - at_lo) / lo, 0.0)
    return max(at_lo - per * lo, 0.0), per


def parameter_counts(params) -> dict:
    """What the memory model needs of a model's parameters: all of them, the trainable ones
    (requires_grad: gradients and optimizer state) and each kind's element size (a frozen base may
    be kept in bf16 beside fp32 adapters)."""
    params = list(params)
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    n_frozen = sum(p.numel() for p in frozen)
    return {"n_params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in train),
            "param_bytes": (train or params)[0].element_size() if params else 4,
            "frozen_param_bytes": (sum(p.numel() * p.element_size() for p in frozen) / n_frozen
                                   if n_frozen else None)}


def plan_memory(*, n_params: int, param_bytes: int, optimizer: torch.optim.Optimizer, wrapped, world_size: int,
                micro_batch: int, accumulates: bool, activation_per_sample: float | None,
                checkpointing: bool, activation_fixed: float = 0.0, trainable: int | None = None,
                frozen_param_bytes: float | None = None) -> MemoryPlan:
    """This rank's planned peak: memory.state_bytes for its sharding (gradients and optimizer state
    for the `trainable` parameters only) plus its micro-batch's activations."""
    kind = optimizer_kind(optimizer)
    state = state_bytes(n_params, sharding=wrapped.strategy, world_size=world_size, fraction=wrapped.fraction,
                        optimizer=kind or "sgd", param_bytes=param_bytes,
                        state_bytes_per_value=param_bytes, unit_params=wrapped.units,
                        root_params=wrapped.root_params, accumulates=accumulates, trainable=trainable,
                        frozen_param_bytes=frozen_param_bytes)
    note = "" if kind else f"optimizer {type(optimizer).__name__} not in the memory model: its state not planned"
    return MemoryPlan(strategy=wrapped.strategy, state=state, micro_batch=micro_batch,
                      activation_per_sample=activation_per_sample, activation_fixed=activation_fixed,
                      checkpointing=checkpointing, note=note)


def measured_peak(device: torch.device, meter) -> float | None:
    """`meter`: the device hooks' byte counter, where the device has one (None: read the allocator)."""
    if meter is not None:
        return float(meter.peak)
    if device.type == "cuda":        # reserved: an OOM from fragmentation shows there, not in allocated
        return float(torch.cuda.max_memory_reserved(device))
    return None


def report(*, plan, memory_plan: MemoryPlan | None, rank: int, world_size: int, device: torch.device,
           meter, log, peak: float | None = None) -> list[dict]:
    """Every rank's planned and measured peak, side by side (a collective; rank 0 prints). `peak`:
    the run's peak as the device hooks kept it (CUDA's allocator peak is reset every step);
    `meter`: the hooks' byte counter, where the device has one."""
    peak = peak or measured_peak(device, meter)
    cap = meter.cap if meter is not None else (
        usable_bytes(device) if device.type == "cuda" else None)
    mp = memory_plan
    mine = {"planned": mp.total if mp else -1.0,
            "planned_state": mp.state.total if mp else -1.0,
            "planned_activations": (mp.activations if mp and mp.activations is not None else -1.0),
            "measured": peak if peak is not None else -1.0,
            "held_state": float(meter.fixed) if meter is not None else -1.0,
            "cap": float(cap) if cap else -1.0, "host": mp.host if mp else 0.0}
    table = agree.exchange(mine, rank=rank, world_size=world_size, device=device)
    rows, out = [], []
    offloads = any(table.column("host"))      # a column only when some rank keeps its optimizer state on the host
    for r in range(world_size):
        v = {k: (None if x < 0 else x) for k, x in table.row(r).items()}
        d = plan.devices[r] if plan is not None else None
        out.append({"rank": r, "device": d.device if d else "", **v})

        def fmt(x):
            return format_bytes(x) if x is not None else "-"
        ratio = (f"{v['measured'] / v['planned']:.2f}" if v["measured"] and v["planned"] else "-")
        rows.append((r, d.device if d else "", fmt(v["planned"]), fmt(v["measured"]), ratio,
                     fmt(v["held_state"]), fmt(v["cap"]), _checkpointed(d))
                    + ((fmt(v["host"] or None),) if offloads else ()))
    strategy = mp.strategy if mp else "none"
    how = ("counted bytes, the device's meter" if meter is not None else
           "CUDA allocator" if device.type == "cuda" else "not measured on a plain CPU: nothing counts its bytes")
    log.table(f"memory per device, sharding={strategy} (planned: state + micro-batch activations; "
              f"measured: {how})",
              ("rank", "device", "planned", "measured", "ratio", "state", "memory", "ckpt")
              + (("on host",) if offloads else ()), rows)
    if mp is not None and mp.note and rank == 0:
        log.info(f"  {mp.note}")
    return out


def _checkpointed(d) -> str:
    """The ckpt column: no, yes (every block), or the plan's count of blocks."""
    if d is None or not d.checkpointing:
        return "no"
    return "yes" if d.checkpoint_blocks is None else f"{d.checkpoint_blocks} blocks"


def _free_for_state(job, params, act_bytes: float | None) -> float | None:
    """Bytes this rank has left for sharded optimizer state: its memory (less the margin) minus
    parameters, gradients and its micro-batch's activations. None when nothing caps memory."""
    cfg, meter, device = job.config, job.hooks.meter, job.device
    if meter is not None and meter.cap is not None:
        return meter.cap * (1 - cfg.memory.margin) - meter.fixed - (act_bytes or 0.0)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        return free * (1 - cfg.memory.margin) - grads - (act_bytes or 0.0)
    return None


@dataclass(frozen=True)
class Activations:
    """This rank's saved-activation bytes as a plan runs the model (None: not measured), and what
    they were measured for: its checkpointing and the most samples measured."""

    key: tuple
    fixed: float | None = None
    per_sample: float | None = None

    def bytes_for(self, micro_batch: int) -> float | None:
        return None if self.per_sample is None else self.fixed + self.per_sample * micro_batch


def _activations_key(job, plan) -> tuple:
    me = plan.devices[job.rank]
    return me.checkpointing, me.checkpoint_blocks, min(me.micro_batch, len(job.dataset))


def activations_for(job, model, forward, plan, *, known: Activations | None = None,
                    applied: bool = False) -> Activations:
    """This rank's activations as `plan` will run the model (its checkpointing, autocast): `known`
    when measured for the same, else measured on two micro-batch sizes, on a device whose bytes
    are counted (CUDA's allocator, or its hooks' meter) when hetrain can call the model.
    `applied`: the plan's checkpointing is on the model already (else put on for the measurement)."""
    key = _activations_key(job, plan)
    if known is not None and known.key == key:
        return known
    if not ((job.hooks.meter is not None or job.device.type == "cuda") and job.unmeasured is None):
        return Activations(key)
    from .activation_checkpointing import applied_for_now

    cfg = job.config
    with contextlib.nullcontext() if applied else applied_for_now(
            model, plan, job.rank, mode=cfg.memory.activation_checkpointing, block_type=cfg.memory.blocks):
        fixed, per = measure_activations(job.load, model=model, forward=forward, device=job.device,
                                         autocast=lambda: job.precision.autocast(job.device.type), n_max=key[2])
    return Activations(key, fixed, per)


def sharding_for(job, model, optimizer, forward, plan, *, requested: str | None,
                 known: Activations | None = None) -> tuple[str, Activations | None]:
    """The sharding the wrapper runs for `plan` (a collective when the planner chooses), decided
    before wrapping: the layout object's (sharding/wrap.wrap runs one device unsharded), or for
    DataParallel(sharding=None) the planner's choice (`_auto_sharding`) from this rank's
    activations as the plan runs them (`known` when measured for the same), returned too for the
    build to reuse."""
    if requested is not None:
        return ("none" if job.world_size == 1 else requested), known
    act = activations_for(job, model, forward, plan, known=known)
    counts = parameter_counts(model.parameters())
    return _auto_sharding(job, model, optimizer, plan, act_bytes=act.bytes_for(plan.devices[job.rank].micro_batch),
                          counts=counts), act


def wrap_for_plan(job, model, optimizer, forward, *, strategy: str, activations: Activations | None = None):
    """prepare()'s memory step, after the plan's checkpointing is applied: this rank's activations
    as it will run (`activations` when measured for the same plan: `sharding_for`), the model
    wrapped under `strategy` (decided before: `sharding_for`) (a collective), what the device's
    meter now holds counted, and this rank's peak planned. Returns (Wrapped, MemoryPlan, whether
    in-loop OOM recovery can stay on under this wrapper)."""
    cfg, plan, rank = job.config, job.plan, job.rank
    me = plan.devices[rank]
    params = list(model.parameters())
    counts = parameter_counts(params)
    n_params, param_bytes = counts["n_params"], counts["param_bytes"]
    measured = activations_for(job, model, forward, plan, known=activations, applied=True)
    act, act_fixed = measured.per_sample, measured.fixed
    act_bytes = measured.bytes_for(me.micro_batch)
    meter = job.hooks.meter
    wrapped = sharding.wrap(model, optimizer, strategy=strategy, device=job.device, rank=rank,
                         world_size=job.world_size, free_bytes=_free_for_state(job, params, act_bytes),
                         block_type=cfg.memory.blocks, accumulates=me.n_micro > 1, meter=meter)
    if meter is not None:
        meter.set_fixed(model, wrapped.optimizer)     # this rank's shards, now
    oom_recovery = cfg.memory.oom_recovery and wrapped.strategy != "capacity-full"  # off there: sharding/wrap.py
    if wrapped.strategy == "fsdp" and oom_recovery and job.unmeasured is not None:
        oom_recovery = False     # its guard learns a step's collectives by calling the model
        wrapped.lines.append("  in-loop OOM recovery under FSDP2: off (hetrain could not call the model to learn "
                             "a step's collectives)")
    if wrapped.strategy == "fsdp" and oom_recovery and not fsdp_redoes_a_broken_step():
        oom_recovery = False
        wrapped.lines.append("  in-loop OOM recovery under FSDP2 is off: this torch cannot reset FSDP2 after a broken "
                             "step (reset_iter_state: torch 2.13+); an OOM ends the attempt and --max-restarts "
                             "resumes with half the micro-batch")
    if wrapped.strategy == "fsdp" and oom_recovery:
        # An OOM mid-step leaves collectives owed to the peers: learn one step's, to complete them
        # (runtime/sharding/fsdp_guard.py). Two samples: BatchNorm cannot train on one.
        from ..sharding.fsdp_guard import one_step

        batch = job.load(range(min(2, len(job.dataset))))
        count = wrapped.sync.make_guard(lambda: one_step(
            model, batch, forward=forward, device=job.device,
            autocast=lambda: job.precision.autocast(job.device.type)))
        wrapped.lines.append(f"  in-loop OOM recovery under FSDP2: a step's {count} collectives recorded, "
                             "an OOM completes the rest with zeros and every rank redoes the step")
    mp = plan_memory(n_params=n_params, param_bytes=param_bytes, optimizer=optimizer, wrapped=wrapped,
                     world_size=job.world_size, micro_batch=me.micro_batch, accumulates=me.n_micro > 1,
                     activation_per_sample=act, activation_fixed=act_fixed or 0.0,
                     checkpointing=me.checkpointing, trainable=counts["trainable"],
                     frozen_param_bytes=counts["frozen_param_bytes"])
    return wrapped, mp, oom_recovery


def _auto_sharding(job, model, optimizer, plan, *, act_bytes: float | None, counts: dict) -> str:
    """DataParallel(sharding=None): 'none' unless the unsharded model state and activations do not fit some
    device; then the first strategy that fits (planning/memory.py's order), with every option's
    memory per device shown. Decided from values every rank exchanged, so all ranks agree."""
    from . import offload
    from .activation_checkpointing import find_blocks

    cfg, meter, device = job.config, job.hooks.meter, job.device
    cap = meter.cap if meter is not None else (
        usable_bytes(device) if device.type == "cuda" else None)
    me = plan.devices[job.rank]
    table = agree.exchange({"usable": cap * (1 - cfg.memory.margin) if cap else -1.0, "act": act_bytes or 0.0,
                            "accumulates": float(me.n_micro > 1)},
                           rank=job.rank, world_size=job.world_size, device=device)
    usable = table.column("usable")
    if job.world_size == 1 or any(u < 0 for u in usable):
        return "none"          # nothing to shard across, or memory not capped: nothing to decide
    devices = [DeviceMemory(label=d.device, capacity=u, activations=a)
               for d, u, a in zip(plan.devices, usable, table.column("act"))]
    blocks = [b for _, b in find_blocks(model, cfg.memory.blocks)]
    in_units = {id(p) for b in blocks for p in b.parameters()}
    options = sharding_options(
        counts["n_params"], devices, optimizer=optimizer_kind(optimizer) or "sgd", param_bytes=counts["param_bytes"],
        unit_params=[sum(p.numel() for p in b.parameters()) for b in blocks],
        root_params=sum(p.numel() for p in model.parameters() if id(p) not in in_units),
        accumulates=[bool(a) for a in table.column("accumulates")], trainable=counts["trainable"],
        frozen_param_bytes=counts["frozen_param_bytes"])
    options = offload.options_with_offload(options, offload.offloading(cfg.memory.offload_optimizer, plan))
    chosen, why = choose_sharding(options, devices)     # raises, on every rank alike, if nothing fits
    if chosen.strategy != "none":
        job.log.table(
            "sharding options: model state + activations per device (usable memory: "
            + ", ".join(f"{d.label} {format_bytes(d.capacity)}" for d in devices) + ")",
            ("sharding", *[d.label for d in devices], "fits"),
            [(o.strategy, *[format_bytes(p) for p in o.peak], "yes" if o.fits(devices) else "no")
             for o in options])
        job.log.info(f"DataParallel(sharding=None): the planner chose {chosen.strategy}: {why}")
    return chosen.strategy


def show_wrapping(log, wrapped) -> None:
    for line in wrapped.lines:
        if wrapped.strategy == "none":      # sharding asked for but not possible: say so, loudly
            log.warn_job(line)
        else:
            log.info(line)
