"""Every layout the runtime runs, ranked for one model on one mixed cluster (pure: no torch).

    layout            what each device holds                      communication per step
    DP                the whole model state                       all-reduce of the gradients (G)
    DP + ZeRO-1       optimizer state 1/W                         + all-gather of the parameters (P)
    DP + capacity     optimizer state ∝ its free memory           + the same all-gather (uneven slices)
    FSDP2             params, grads, state 1/W (+2 units)         all-gather P twice + reduce-scatter G
                                                                  (timed by `hetrain plan` when it can:
                                                                  runtime/measure/fsdp_probe.py)
                      (whole params and grads on a rank that
                      accumulates micro-batches: wrap.py)
    capacity-full     params, grads, state ∝ free memory (+units)  as FSDP2, modelled (uneven slices)
    PP, DP×PP         its stage's blocks                          activations between stages; the
                                                                  stages' G over the replicas
    TP                every layer 1/W                             4 activation all-reduces per layer

Data-parallel layouts share hetrain's planner (planner.make_plan): shares by speed, micro-batches
by memory, activation checkpointing per device where one sample needs it (the fewest blocks), and
optimizer-state offload to host memory on the smallest cards where that is what fits (savers.py).
Only the bytes of model state each device holds change (memory.state_bytes), and the collectives
the sharding adds. The
pipelines come from parallelism.compare_parallelism, which sizes their stages to each device's
speed. TP: one group over every device, split evenly or by speed (tensor_split.py).

The ranking is by predicted samples/s among the layouts that fit. The recommendation is the
chooser's (planning/chooser.py, the one rule parallel='auto' runs): the fastest the request allows,
or a simpler one within `prefer_simpler_within` of it (ORDER, fewer collectives for the same speed).
When nothing fits, `to_fit` says what would make one fit
(layout_fit.py). Sizes: one make_plan per data-parallel layout (FSDP and capacity-full up to 3
when ranks accumulate) plus one compare_parallelism; the search's cost is theirs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import UsageError
from ..hardware.units import compact, device_kinds, format_bytes
from .collectives import all_gather_seconds, send_seconds
from .memory import state_bytes
from .options import PlanOptions, ring_link
from .savers import dp_plan, fit_with_offload, saver_cells, uses
from .profile import DeviceProfile
# In rows.py (a leaf the chooser, memory and tensor_split import too), still importable from here.
from .rows import FAMILIES, ORDER, TP_COMM_PER_ACTIVATION, LayoutRow, seconds  # noqa: F401 (re-exported)

# What one stage sends the next per sample, as a fraction of one block's saved activations: a
# transformer block's output is s·h values (2 bytes at bf16) against ≈ 34·s·h bytes it keeps.
BOUNDARY_PER_ACTIVATION = 2 / 34
MAX_MICRO_BATCHES = 128           # pipelines: the most micro-batches tried per step
GATHERED = ("fsdp", "capacity-full")   # parameters gathered per unit: a rank that accumulates holds them whole


@dataclass(frozen=True, kw_only=True)
class ModelState:
    """The model as memory sees it: what each layout divides."""

    params: int                         # all parameters
    trainable: int                      # with gradients and optimizer state
    optimizer: str = "adamw"
    param_bytes: int = 4                # trainable weights (fp32 masters)
    frozen_param_bytes: float = 4       # frozen weights (bf16: 2)
    blocks: int | None = None           # equal blocks a pipeline can cut between; FSDP's units
    root_params: int = 0                # parameters outside the blocks
    device_param_bytes: float = 4       # an offloading device's weights and gradients (training precision)
    # TP: bytes all-reduced per byte of saved activations (a transformer's unless the model's
    # layers say otherwise: tp_comm_ratio), and why TP cannot split this model ('' : it can).
    tp_comm_per_activation: float = TP_COMM_PER_ACTIVATION
    tp_refused: str = ""
    tp_pairs: int = 0                   # the attention and MLP pairs TP splits (0: not known)

    @classmethod
    def from_spec(cls, spec, *, precision: str = "bf16", optimizer: str = "adamw") -> ModelState:
        """A catalog model (profile.ModelSpec): a frozen part is kept at the training precision
        (cost.fixed_bytes's rule), what trains in fp32."""
        from .cost import ELEMENT_BYTES

        return cls(params=spec.params, trainable=spec.trainable, optimizer=optimizer, blocks=spec.blocks,
                   frozen_param_bytes=ELEMENT_BYTES[precision] if spec.frozen else 4,
                   device_param_bytes=ELEMENT_BYTES[precision])

    def state(self, sharding: str, *, world_size: int, fraction: float | None = None,
              accumulates: bool = False, offload: bool = False):
        units = (max(0, self.params - self.root_params) // self.blocks,) * self.blocks if self.blocks else ()
        return state_bytes(self.params, sharding=sharding, world_size=world_size, fraction=fraction,
                           optimizer=self.optimizer, param_bytes=self.param_bytes, trainable=self.trainable,
                           frozen_param_bytes=self.frozen_param_bytes, unit_params=units,
                           root_params=self.root_params if self.blocks else self.params, accumulates=accumulates,
                           offload=offload, device_param_bytes=self.device_param_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.trainable * self.param_bytes + (self.params - self.trainable) * self.frozen_param_bytes

    @property
    def grad_bytes(self) -> float:
        return self.trainable * self.param_bytes


@dataclass(frozen=True, kw_only=True)
class LayoutRanking:
    rows: tuple[LayoutRow, ...]            # fitting ones by samples/s, then the rest
    devices: tuple[str, ...]
    capacity: tuple[float | None, ...]     # usable bytes per device
    best: LayoutRow | None
    why: str                               # why the winner wins (or why none fits)
    to_fit: tuple[str, ...] = ()           # when none fits: what would make one fit
    left_out: tuple[str, ...] = ()         # fitting rows the chooser left out, and why (chooser.Choice)
    not_offered: str = ""                  # why a family has no row (TP on a model it cannot split)

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "devices": list(self.devices),
                "capacity": list(self.capacity), "best": self.best.name if self.best else None,
                "why": self.why, "to_fit": list(self.to_fit), "left_out": list(self.left_out),
                "not_offered": self.not_offered}


def _ring(w: int) -> float:
    return 2 * (w - 1) / w if w > 1 else 0.0


# -- data parallel, with or without sharding --------------------------------------------------
def _dp_row(profiles, state: ModelState, o: PlanOptions, sharding: str, fsdp_excess_s: float | None = None) -> LayoutRow:
    family = FAMILIES[sharding]
    run = ("ht.prepare(..., parallel=hetrain.DataParallel()) (the planner keeps plain DP when it fits)"
           if sharding == "none" else f"ht.prepare(..., parallel=hetrain.DataParallel(sharding={sharding!r}))")
    w = len(profiles)
    try:
        (plan, shaped, capped), offloaded, _ = fit_with_offload(
            lambda off: dp_plan(profiles, state, o, sharding, off, gathered=sharding in GATHERED), profiles, o,
            lambda off: sum(state.state(sharding, world_size=w, offload=True).host for _ in off),
            lambda result: result[0].predicted["samples_per_s"])
    except UsageError as e:
        return LayoutRow(name=family, family=family, fits=False, samples_per_s=0.0, memory=(None,) * w,
                         comm_bytes=0.0, comm_s=0.0, detail=e.what, run=run)
    pred = plan.predicted
    link = ring_link(shaped, o)
    grads, weights = state.grad_bytes, state.weight_bytes
    moved, extra = _ring(w) * grads, 0.0
    if sharding in ("zero1", "capacity"):      # the owners broadcast their updated slices
        extra = all_gather_seconds(w, state.trainable * state.param_bytes, link)
        moved += state.trainable * state.param_bytes * (w - 1) / w
    elif sharding in ("fsdp", "capacity-full") and w > 1:   # gathers forward and backward, a reduce to owners
        moved = (2 * weights + grads) * (w - 1) / w
        if fsdp_excess_s is not None:          # timed on these devices (runtime/measure/fsdp_probe.py)
            extra = fsdp_excess_s
        else:
            gather = all_gather_seconds(w, weights, link)
            crit = pred["compute_s"]
            # Each gather is prefetched under compute (forward ≈ 1/3, backward ≈ 2/3 of it); the first
            # unit's is never hidden. The reduce-scatter is half DDP's all-reduce: kept as DDP's (cautious).
            extra = max(gather / max(state.blocks or 1, 1), gather - crit / 3) + max(0.0, gather - crit * 2 / 3)
    step = pred["step_s"] + extra
    ckpt = [d.device for d in plan.devices if d.checkpointing]
    acc = [d.device for d in plan.devices if d.n_micro > 1]
    detail = (f"shares {compact(d.share for d in plan.devices)}, micro-batches "
              + compact(f"{d.micro_batch}x{d.n_micro}" for d in plan.devices))
    if sharding == "fsdp" and fsdp_excess_s is not None and w > 1:
        detail += f"; FSDP2's collectives and their work measured here: +{seconds(fsdp_excess_s)} a step"
    if sharding in GATHERED and acc:
        detail += f"; {device_kinds(acc)} accumulate, so they hold whole parameters and gradients during the step"
    if capped:
        detail += (f"; {device_kinds([shaped[i].device for i in sorted(capped)])} run their share as one "
                   "micro-batch (whole parameters to accumulate would not fit)")
    cells = saver_cells(plan, shaped, offloaded)
    detail += uses(cells, [d.device for d in plan.devices])
    return LayoutRow(name=family, family=family, fits=True, samples_per_s=o.global_batch / step,
                     memory=tuple(float(d.predicted_memory_bytes or 0) for d in plan.devices),
                     comm_bytes=moved, comm_s=pred.get("comm_exposed_s", 0.0) + extra, detail=detail, run=run,
                     recompute=tuple(ckpt), savers=cells)


# -- tensor parallel over every device ---------------------------------------------------------
def _tp_row(profiles, state: ModelState, o: PlanOptions) -> LayoutRow:
    w, b, margin = len(profiles), o.global_batch, o.memory_margin
    name, run = f"TP {w}", "ht.prepare(..., parallel='tp')"
    from ..runtime.layouts.tensor.split import tp_comm_seconds, tp_micro_batch

    st = state.state("fsdp", world_size=w, accumulates=False)
    held = st.params + st.grads + st.optimizer          # every weight split W ways, nothing gathered
    m, _ = tp_micro_batch(profiles, (1 / w,) * w, global_batch=b, margin=margin)     # the runtime's
    if m < 1:
        short = min(profiles, key=lambda p: p.memory_bytes or math.inf)
        return LayoutRow(name=name, family="TP", fits=False, samples_per_s=0.0, memory=(None,) * w, comm_bytes=0.0,
                         comm_s=0.0, run=run, detail=f"1/{w} of the model state ({format_bytes(held)}) and one "
                         f"sample's activations do not fit {short.device}")
    n_micro = math.ceil(b / m)
    slowest = max(profiles, key=lambda p: p.per_sample_s)
    compute = n_micro * slowest.overhead_s + b * slowest.per_sample_s / w     # fixed part whole: tp_compute_seconds
    per_sample = state.tp_comm_per_activation * max(p.activation_bytes_per_sample for p in profiles)
    link = ring_link(profiles, o)
    comm = tp_comm_seconds(w, n_micro=n_micro, micro_bytes=math.ceil(b / n_micro) * per_sample, link=link,
                           pairs=state.tp_pairs, floor_s=o.agree_s)
    step = compute + comm + max(p.optimizer_s for p in profiles) / w
    # at most: a shard saves the replicated layers' activations whole (tensor_split.py's docstring)
    mem = tuple(held + p.activation_fixed_bytes + p.activation_bytes_per_sample * m for p in profiles)
    return LayoutRow(name=name, family="TP", fits=True, samples_per_s=b / step, memory=mem,
                     comm_bytes=_ring(w) * b * per_sample, comm_s=comm, run=run,
                     detail=f"every layer split {w} ways, so every device runs at {slowest.device}'s speed; "
                            f"micro-batch {m}x{n_micro}, activation all-reduces {seconds(comm)} per step")


# -- pipelines ---------------------------------------------------------------------------------
def measured_pipeline(data: dict | None):
    """(PipelineProfile, [StageDevice]) from what `hetrain plan` measured (Measurements.pipeline),
    or None."""
    from ..runtime.layouts.pipeline.split import PipelineProfile, StageDevice

    if not data:
        return None
    return PipelineProfile.from_dict(data["profile"]), [StageDevice(**d) for d in data["devices"]]


def _pipeline_rows(profiles, state: ModelState, o: PlanOptions, *, schedule: str, pipeline=None) -> list[LayoutRow]:
    from .parallelism import compare_parallelism, on_host, with_fixed_cost, with_step_work
    from ..runtime.layouts.pipeline.split import PipelineProfile, StageDevice

    w = len(profiles)
    if w < 2 or not state.blocks:
        return []
    fastest = min(profiles, key=lambda p: p.per_sample_s)
    if pipeline is not None:     # the blocks as the runtime measured them, and its devices
        layer, devices = pipeline
    else:                        # equal blocks from the whole-model profile (catalog, or blocks unmeasured)
        layer = PipelineProfile.uniform(
            n_blocks=state.blocks, seconds_per_sample=fastest.per_sample_s,
            activation_bytes_per_sample=fastest.activation_bytes_per_sample, param_bytes=state.weight_bytes,
            boundary_bytes=BOUNDARY_PER_ACTIVATION * fastest.activation_bytes_per_sample / state.blocks,
            source=f"{state.blocks} equal blocks from {fastest.device}'s whole-model profile")
        devices = [StageDevice(name=p.device, speed=fastest.per_sample_s / p.per_sample_s,
                               memory_bytes=p.memory_bytes) for p in profiles]
    factor = state.state("none", world_size=1).total / max(state.weight_bytes, 1.0)
    link = ring_link(profiles, o)
    host = next((p.host for p in profiles if p.host is not None), None)
    # More micro-batches make each smaller (less activation memory in flight, a smaller bubble):
    # a layout that does not fit at 8 is tried again at 16, 32, ... up to one sample per micro-batch.
    found: dict[str, object] = {}
    m = 8
    while True:
        choice = compare_parallelism(layer, devices, global_batch=o.global_batch, schedule=schedule,
                                     state_factor=factor, memory_margin=o.memory_margin, link=link,
                                     micro_batches=m, require_fit=False,
                                     grad_fraction=state.grad_bytes / max(state.weight_bytes, 1.0))
        # A measured pipeline's stages already cost as stages run (PipelineProfile.stage_factor, block_s).
        for c in (on_host(c if layer.stage_factor != 1.0 or layer.block_s else
                          with_fixed_cost(c, fastest, global_batch=o.global_batch, micro_batches=m,
                                          schedule=schedule), host, layer)
                  for c in choice.candidates):
            # Kept: the fastest that fits, else the last try that gave each replica m micro-batches.
            was = found.get(c.name)
            if c.kind != "dp" and (was is None or (not was.fits and m * c.replicas <= o.global_batch)
                                   or c.samples_per_s > was.samples_per_s):
                found[c.name] = c
        if all(c.fits for c in found.values()) or m >= min(o.global_batch, MAX_MICRO_BATCHES):
            break
        m *= 2
    candidates = [with_step_work(c, profiles, o) for c in found.values()]
    rows = []
    for c in candidates:
        if c.kind == "dp" or c.stages > state.blocks:      # more stages than blocks: never a layout
            continue
        family = "PP" if c.kind == "pp" else "DP×PP"
        stage_grads = state.grad_bytes / max(c.stages, 1)
        # Each stage's gradients over the replicas; activations forward and their gradients back.
        moved = _ring(c.replicas) * stage_grads + 2 * o.global_batch / c.replicas * layer.boundary_bytes
        # The sends are inside each stage's time (pipeline_split.py); shown: one boundary's whole step.
        sends = 2 * send_seconds(o.global_batch / c.replicas * layer.boundary_bytes, link) if c.stages > 1 else 0.0
        rows.append(LayoutRow(
            name=c.name, family=family, stages=c.stages, fits=c.fits, samples_per_s=c.samples_per_s,
            memory=c.memory if c.fits else (None,) * w, comm_bytes=moved if c.fits else 0.0, comm_s=c.sync_s + sends,
            detail=c.detail,
            run=f"ht.prepare(..., parallel=hetrain.Pipeline({'' if family == 'PP' else f'stages={c.stages}'}))"))
    return rows


# -- the ranking -------------------------------------------------------------------------------
def rank_layouts(profiles: Sequence[DeviceProfile], *, state: ModelState, options: PlanOptions,
                 schedule: str = "1f1b", prefer_simpler_within: float = 0.05, pipeline=None,
                 fsdp_excess_s: float | None = None, tp_measured: dict | None = None,
                 request=None) -> LayoutRanking:
    """Predict every layout on these devices (profiles hold each device's speed, memory and
    activations; their fixed_bytes are replaced by each layout's own) and rank them. `pipeline`:
    (PipelineProfile, [StageDevice]) of measured blocks (measured_pipeline), else equal blocks.
    `fsdp_excess_s`: an FSDP2 step's seconds beyond DP's, as `hetrain plan` timed them (else modelled).
    `tp_measured`: a step of the model split by speed as `hetrain plan` timed it (runtime/measure/
    tp_probe.py: {"fb_s", "opt_s", "micro_batch"}), for the TP-by-speed row (else modelled).
    `request`: what the chooser may pick (chooser.Request; None: parallel='auto' of a default job)."""
    from .chooser import AUTO, spec_of
    from .layout_fit import what_would_fit
    from ..runtime.layouts.tensor.split import speed_tp_row

    profiles = list(profiles)
    if not profiles:
        raise UsageError("no devices to rank layouts on", "give at least one device")
    rows = [_dp_row(profiles, state, options, s, fsdp_excess_s if s == "fsdp" else None)
            for s in ("none", "zero1", "capacity", "fsdp", "capacity-full")]
    if len(profiles) > 1:
        rows += _pipeline_rows(profiles, state, options, schedule=schedule, pipeline=pipeline)
    if len(profiles) > 1 and not state.tp_refused:
        even = _tp_row(profiles, state, options)
        if tp_measured and even.fits:     # said, so the modelled row is not read beside the timed one as its equal
            even = replace(even, detail=f"{even.detail} (modelled: only the split by speed was timed here)")
        rows.append(even)
        rows.append(speed_tp_row(profiles, options, measured=tp_measured,                # tensor_split.py
                                 comm_per_activation=state.tp_comm_per_activation, pairs=state.tp_pairs))
    rows = [r if r.spec else replace(r, spec=spec_of(r)) for r in rows]     # the row says what runs
    capacity = tuple(p.memory_bytes * (1 - options.memory_margin) if p.memory_bytes else None for p in profiles)
    devices = tuple(p.device for p in profiles)
    ranking = LayoutRanking(rows=tuple(sorted(rows, key=lambda r: (not r.fits, -r.samples_per_s))), devices=devices,
                            capacity=capacity, best=None, why="",
                            not_offered=f"TP not offered: {state.tp_refused}" if len(profiles) > 1 and state.tp_refused
                            else "")
    ranking = with_choice(ranking, replace(request or AUTO, within=prefer_simpler_within))
    if ranking.best is None and not any(r.fits for r in rows):
        return replace(ranking, to_fit=tuple(what_would_fit(profiles, state, options)))
    return ranking


def with_choice(ranking: LayoutRanking, request) -> LayoutRanking:
    """The ranking with its best row and why as the chooser (planning/chooser.py) picks for
    `request`, that row first, then the rest that fit by samples/s, then those that do not."""
    from .chooser import choose

    c = choose(ranking.rows, request)
    rest = sorted((r for r in ranking.rows if r is not c.row), key=lambda r: (not r.fits, -r.samples_per_s))
    return replace(ranking, best=c.row, why=c.why, left_out=c.left_out,
                   rows=((c.row,) if c.row is not None else ()) + tuple(rest))
