"""Device islands joined by a host bridge: which of three ways to train pays (pure: no torch).

    hierarchical DP     every device of every island trains, shares by speed (the planner's);
                        the gradient all-reduce is hierarchical across the bridge
                        (bridge_cost.hierarchical_allreduce), handed to the planner as the one
                        ring link that takes as long (collectives.link_from_measurement)
    PP across islands   one pipeline stage per island (blocks in proportion to the island's
                        speed), DP inside each island on its own link; activations and their
                        gradients cross the bridge at every boundary, staged through host memory
    only islands that pay
                        the best proper subset of the islands trains alone (no bridge when it is
                        one island): the answer when the bridge costs more than the islands left
                        out add

The choice is the chooser's rule (chooser.simplest_within): the fastest, or a simpler one within
5% of it, simpler meaning fewer islands joined or fewer crossings: only the islands that pay,
then hierarchical DP, then the pipeline. When a subset wins, `Comparison.verdict` says so in one line with the figures; a CPU
island gets its own line (`cpu_line`): its share, or why it is left out, and what it would cost
holding offloaded optimizer state instead (the same host link, bridge_cost.offload_step_seconds).

The pipeline is modelled, not searched: 1F1B with M micro-batches over k stages lasts
(M + k − 1) × the slowest stage's micro-batch (its compute, its overhead, and both crossings of
each of its boundaries, staged and not overlapped), plus each island's all-reduce of its stage's
gradients and the optimizer. Memory: a device holds its stage's share of the model state and of
k micro-batches' activations (its part of each, DP splitting a micro-batch by the island's size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from ..errors import UsageError
from ..hardware.units import format_bytes
from .bridge_cost import (BridgeAllReduce, Island, boundary_seconds, hierarchical_allreduce, offload_step_seconds)
from .chooser import PREFER_SIMPLER_WITHIN, simplest_within
from .collectives import Link, allreduce_seconds, link_from_measurement
from .options import PlanOptions
from .planner import make_plan
from .profile import DeviceProfile

HIER, PP, SUBSET = "hierarchical DP", "PP across islands", "only the islands that pay"
SIMPLER = {SUBSET: 0, HIER: 1, PP: 2}
BOUNDARY_PER_ACTIVATION = 2 / 34      # a block's output against its saved activations (ranking.py's figure)
PIPELINE_MICRO_PER_STAGE = 4          # micro-batches per stage: the bubble (k−1)/(M+k−1) stays under 20%
MAX_SUBSETS = 63                      # 6 islands; beyond, only each island alone and all but one


@dataclass(frozen=True, kw_only=True)
class Option:
    name: str
    islands: tuple[str, ...]          # the islands that train
    fits: bool
    samples_per_s: float
    step_s: float
    compute_s: float                  # the step's compute (the critical device's, or the pipeline's)
    bridge_s: float                   # what crossing the bridge adds to a step (staging + bridge)
    detail: str
    shares: tuple[tuple[str, int], ...] = ()     # DP options: (device, share) of those that train

    def to_dict(self) -> dict:
        return {"name": self.name, "islands": list(self.islands), "fits": self.fits,
                "samples_per_s": self.samples_per_s, "step_s": self.step_s if math.isfinite(self.step_s) else None,
                "compute_s": self.compute_s,
                "bridge_s": self.bridge_s, "detail": self.detail, "shares": [list(s) for s in self.shares]}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    options: tuple[Option, ...]       # hierarchical DP, PP, only the islands that pay (in that order)
    best: Option | None
    verdict: str                      # one line: what trains and why, with the figures
    cpu_line: str = ""                # a CPU island: its share or why it is left out ('' : none)
    warning: str = ""                 # the bridge cannot carry a step's gradient in the step's time
    allreduce: BridgeAllReduce | None = None

    def to_dict(self) -> dict:
        return {"options": [o.to_dict() for o in self.options], "best": self.best.name if self.best else None,
                "verdict": self.verdict, "cpu": self.cpu_line, "warning": self.warning,
                "allreduce": None if self.allreduce is None else {
                    "within_s": self.allreduce.within_s, "staging_s": self.allreduce.staging_s,
                    "bridge_s": self.allreduce.bridge_s, "total_s": self.allreduce.total_s,
                    "leaders": self.allreduce.leaders}}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _names(islands: Sequence[Island]) -> str:
    return " + ".join(i.name for i in islands)


def _dp(islands: Sequence[Island], profiles: Sequence[DeviceProfile], options: PlanOptions, bridge: Link,
        name: str, *, every_device: bool) -> tuple[Option, BridgeAllReduce]:
    members = [j for i in islands for j in i.devices]
    sub = [profiles[j] for j in members]
    ar = hierarchical_allreduce(islands, options.grad_bytes, bridge)
    link = (islands[0].link if len(islands) == 1 else
            link_from_measurement(len(members), options.grad_bytes, ar.total_s,
                                  f"hierarchical across {len(islands)} islands over the bridge ({bridge.source})"))
    o = replace(options, link=link, allow_exclusion=options.allow_exclusion and not every_device)
    names = tuple(i.name for i in islands)
    try:
        plan = make_plan(sub, o)
    except UsageError as e:
        return Option(name=name, islands=names, fits=False, samples_per_s=0.0, step_s=math.inf, compute_s=0.0,
                      bridge_s=ar.crossing_s, detail=e.what), ar
    p = plan.predicted
    shares = tuple((d.device, d.share) for d in plan.devices)
    detail = (f"{_names(islands)}: shares " + ", ".join(f"{d} {s}" for d, s in shares)
              + (f"; gradient all-reduce {_ms(ar.total_s)} ({_ms(ar.within_s)} inside the islands, "
                 f"{_ms(ar.staging_s)} staged over PCIe, {_ms(ar.bridge_s)} over the bridge"
                 + (", one leader per island" if ar.leaders else "") + ")" if len(islands) > 1 else ""))
    return Option(name=name, islands=names, fits=True, samples_per_s=p["samples_per_s"], step_s=p["step_s"],
                  compute_s=p["compute_s"], bridge_s=ar.crossing_s if len(islands) > 1 else 0.0, detail=detail,
                  shares=shares), ar


def pipeline_option(islands: Sequence[Island], profiles: Sequence[DeviceProfile], *, global_batch: int,
                    grad_bytes: float, blocks: int | None, bridge: Link, memory_margin: float = 0.10) -> Option:
    """One stage per island, DP inside each (the module docstring's model)."""
    names = tuple(i.name for i in islands)
    k = len(islands)
    if k < 2 or not blocks or blocks < k:
        why = "one island" if k < 2 else f"the model has {blocks or 'no'} blocks to cut into {k} stages"
        return Option(name=PP, islands=names, fits=False, samples_per_s=0.0, step_s=math.inf, compute_s=0.0,
                      bridge_s=0.0, detail=f"not offered: {why}")
    rates = [sum(1 / profiles[j].per_sample_s for j in i.devices) for i in islands]   # whole-model samples/s
    cut = _split(blocks, rates)
    act = max(profiles[j].activation_bytes_per_sample for j in range(len(profiles)))
    # More micro-batches make each smaller (less activation memory in flight, a smaller bubble):
    # from PIPELINE_MICRO_PER_STAGE a stage, doubled until every device fits, up to one sample each.
    m_count = min(global_batch, PIPELINE_MICRO_PER_STAGE * k)
    while True:
        micro = global_batch / m_count
        boundary = BOUNDARY_PER_ACTIVATION * act / blocks * micro          # one micro-batch's activations out
        per_stage, too_big = _stages(islands, profiles, cut, blocks, micro, boundary, bridge, memory_margin)
        if not too_big or m_count >= global_batch:
            break
        m_count = min(global_batch, 2 * m_count)
    slowest = max(range(k), key=lambda s: per_stage[s])
    sync = max(allreduce_seconds(i.size, grad_bytes * b / blocks, i.link) for i, b in zip(islands, cut))
    opt = max(profiles[j].optimizer_s * b / blocks for i, b in zip(islands, cut) for j in i.devices)
    step = (m_count + k - 1) * per_stage[slowest] + sync + opt
    crossing = 2 * boundary_seconds(boundary, islands[0], islands[1], bridge) * m_count
    detail = (f"stages {', '.join(f'{i.name} {b} blocks' for i, b in zip(islands, cut))}; {m_count} micro-batches "
              f"of {micro:.3g}; each boundary sends {format_bytes(boundary)} a micro-batch each way "
              f"({_ms(boundary_seconds(boundary, islands[0], islands[1], bridge))} staged and over the bridge); "
              f"slowest stage {islands[slowest].name}")
    if too_big:
        detail += f"; does not fit {', '.join(too_big)}"
    return Option(name=PP, islands=names, fits=not too_big, samples_per_s=global_batch / step if not too_big else 0.0,
                  step_s=step, compute_s=(m_count + k - 1) * per_stage[slowest], bridge_s=crossing, detail=detail)


def _stages(islands, profiles, cut, blocks, micro, boundary, bridge, margin) -> tuple[list[float], list[str]]:
    """Each stage's seconds a micro-batch (compute, overhead, its boundaries' crossings), and the devices
    its state and k micro-batches in flight do not fit."""
    k = len(islands)
    per_stage, too_big = [], []
    for s, (isl, b) in enumerate(zip(islands, cut)):
        rate = sum(1 / profiles[j].per_sample_s for j in isl.devices)
        compute = micro * (b / blocks) / rate + max(profiles[j].overhead_s for j in isl.devices)
        # Each boundary is crossed twice a micro-batch (the activation on, its gradient back), and
        # both its stages take part in each crossing (a staged copy on each side, the bridge
        # between), without overlapping their compute: the host-staged path blocks.
        sends = sum(2 * boundary_seconds(boundary, isl, islands[t], bridge) for t in (s - 1, s + 1) if 0 <= t < k)
        per_stage.append(compute + sends)
        for j in isl.devices:          # its stage's state, and its part of k micro-batches in flight
            p = profiles[j]
            need = p.fixed_bytes * b / blocks + p.activation_bytes_per_sample * b / blocks * micro / isl.size * k
            if p.memory_bytes and need > p.memory_bytes * (1 - margin):
                too_big.append(p.device)
    return per_stage, too_big


def _split(blocks: int, rates: Sequence[float]) -> list[int]:
    """`blocks` in proportion to `rates`, each stage at least one (largest remainders)."""
    total = sum(rates)
    raw = [blocks * r / total for r in rates]
    cut = [max(1, int(x)) for x in raw]
    while sum(cut) > blocks:
        cut[max(range(len(cut)), key=lambda s: (cut[s] - raw[s], cut[s]))] -= 1
    while sum(cut) < blocks:
        cut[max(range(len(cut)), key=lambda s: raw[s] - cut[s])] += 1
    return cut


def _subsets(k: int) -> list[tuple[int, ...]]:
    every = [c for n in range(1, k) for c in combinations(range(k), n)]
    if len(every) <= MAX_SUBSETS:
        return every
    return [(i,) for i in range(k)] + [tuple(j for j in range(k) if j != i) for i in range(k)]


def compare(islands: Sequence[Island], profiles: Sequence[DeviceProfile], options: PlanOptions, *, bridge: Link,
            blocks: int | None = None, trainable: int = 0, element_bytes: float = 2.0,
            state_bytes_per_param: float = 8.0, within: float = PREFER_SIMPLER_WITHIN) -> Comparison:
    """The three ways to train these islands, and which runs (module docstring). `options`: the
    job's planner options (its link is replaced by each option's own); `blocks`: the model's
    equal blocks (None: no pipeline); `trainable` and the byte sizes price a CPU holding
    offloaded optimizer state."""
    islands = list(islands)
    hier, ar = _dp(islands, profiles, options, bridge, HIER, every_device=True)
    pp = pipeline_option(islands, profiles, global_batch=options.global_batch, grad_bytes=options.grad_bytes,
                         blocks=blocks, bridge=bridge, memory_margin=options.memory_margin)
    best_sub = None
    for chosen in _subsets(len(islands)):
        part = [islands[i] for i in chosen]
        if options.global_batch < sum(i.size for i in part):
            continue
        opt, _ = _dp(part, profiles, options, bridge, SUBSET, every_device=False)
        if opt.fits and (best_sub is None or opt.samples_per_s > best_sub.samples_per_s):
            best_sub = opt
    sub = best_sub or Option(name=SUBSET, islands=(), fits=False, samples_per_s=0.0, step_s=math.inf,
                             compute_s=0.0, bridge_s=0.0, detail="no island trains alone (memory)")
    opts = (hier, pp, sub)
    fitting = [o for o in opts if o.fits]
    best = simplest_within(fitting, within, simpler=lambda o: SIMPLER[o.name]) if fitting else None
    comparison = Comparison(options=opts, best=best, verdict=_verdict(best, opts, islands, within), allreduce=ar,
                            warning=bridge_warning(hier, ar, bridge, options.grad_bytes))
    cpu = [i for i in islands if i.is_cpu]
    if cpu:
        comparison = replace(comparison, cpu_line=cpu_line(cpu, islands, comparison, options, profiles,
                                                            trainable=trainable,
                                                            element_bytes=element_bytes,
                                                            state_bytes_per_param=state_bytes_per_param))
    return comparison


def homogeneous(islands: Sequence[Island], profiles: Sequence[DeviceProfile], like: Island,
                *, native_bridge: bool = True) -> tuple[list[Island], list[DeviceProfile]]:
    """The same islands with every device replaced by `like`'s first device (its profile, link
    and host link): the one-vendor cluster a mixed one is measured against. `native_bridge`:
    its islands talk over the network with their own library (GPUDirect RDMA), nothing staged."""
    model = profiles[like.devices[0]]
    out = [replace(model, device=f"{model.gpu or 'device'}#{j}") for j in range(len(profiles))]
    host = math.inf if native_bridge else like.host_gbs[0]
    same = [replace(i, link=like.link, vendor=like.vendor, host_gbs=(host,) * i.size) for i in islands]
    return same, out


def _verdict(best: Option | None, opts: Sequence[Option], islands: Sequence[Island], within: float) -> str:
    hier, pp, sub = opts
    if best is None:
        return "no way to train these islands fits memory: " + "; ".join(f"{o.name}: {o.detail}" for o in opts)
    if best is sub:
        left = [i.name for i in islands if i.name not in sub.islands]
        joined = max((o for o in (hier, pp) if o.fits), key=lambda o: o.samples_per_s, default=None)
        if joined is None:
            return (f"only {' + '.join(sub.islands)} train{'s' if len(sub.islands) == 1 else ''} "
                    f"({sub.samples_per_s:.1f} samples/s): joined with {', '.join(left)} nothing fits")
        saved = max(0.0, sub.compute_s - hier.compute_s) if hier.fits else 0.0
        close = (f", within {within:.0%} and with fewer islands" if joined.samples_per_s > sub.samples_per_s else "")
        return (f"only {' + '.join(sub.islands)} train{'s' if len(sub.islands) == 1 else ''}: "
                f"{sub.samples_per_s:.1f} samples/s against {joined.samples_per_s:.1f} with {', '.join(left)} "
                f"({joined.name}){close}: joining {', '.join(left)} adds {_ms(joined.bridge_s - sub.bridge_s)} of "
                f"bridge a step and saves {_ms(saved)} of compute")
    others = [o for o in opts if o is not best and o.fits]
    runner = max(others, key=lambda o: o.samples_per_s, default=None)
    line = f"{best.name} over {' + '.join(best.islands)}: {best.samples_per_s:.1f} samples/s"
    if runner is not None:
        line += f" against {runner.samples_per_s:.1f} ({runner.name})"
    if best.name == PP:
        return line + f"; boundary sends over the bridge take {_ms(best.bridge_s)} a step, inside the stages' time"
    return line + f"; the gradient's staging and bridge take {_ms(best.bridge_s)} a step"


def bridge_warning(hier: Option, ar: BridgeAllReduce, bridge: Link, grad_bytes: float) -> str:
    """A warning when the bridge cannot carry a step's gradient in the time the step computes:
    every step then waits on the bridge ('' otherwise)."""
    if not hier.fits or ar.crossing_s <= hier.compute_s or ar.crossing_s == 0.0:
        return ""
    need = 2 * grad_bytes / max(hier.compute_s, 1e-9) / 1e9
    return (f"warning: the bridge ({bridge.bandwidth_gbs:.3g} GB/s, {bridge.source}) needs {_ms(ar.crossing_s)} a "
            f"step to carry {format_bytes(grad_bytes)} of gradients, more than the {_ms(hier.compute_s)} a step "
            f"computes; a bridge of about {need:.3g} GB/s or more, a larger global batch, or training only "
            "the islands that pay avoids the wait")


def cpu_line(cpu: Sequence[Island], islands: Sequence[Island], c: Comparison, options: PlanOptions,
             profiles: Sequence[DeviceProfile], *, trainable: int, element_bytes: float,
             state_bytes_per_param: float) -> str:
    """The CPU island's part, in one line with the figures: its share, or why it is left out, and
    what the same host link would cost it holding a GPU's offloaded optimizer state."""
    hier, _, sub = c.options
    labels = {profiles[j].device for i in cpu for j in i.devices}
    names = ", ".join(i.name for i in cpu)
    b = options.global_batch
    gpu = next((i for i in islands if not i.is_cpu), None)
    offload = ""
    if gpu is not None and trainable:
        gbs = min(gpu.host_gbs)
        cost = offload_step_seconds(trainable=trainable, element_bytes=element_bytes,
                                    state_bytes_per_param=state_bytes_per_param, gbs=gbs)
        offload = (f"; holding one {gpu.name} device's offloaded optimizer state instead costs {_ms(cost)} a step "
                   f"({format_bytes(trainable * element_bytes)} each way over "
                   + (f"its {gbs:g} GB/s PCIe" if math.isfinite(gbs) else "host memory") + " and the host's update)")
    best = c.best
    if best is not None and best.name != PP and any(i.name in best.islands for i in cpu):
        own = sum(s for d, s in best.shares if d in labels)
        if own:
            return (f"the CPU ({names}) trains: {own} of {b} samples a step ({own / b:.1%}); the bridge round "
                    f"it joins costs {_ms(best.bridge_s)}" + offload)
    share = sum(s for d, s in hier.shares if d in labels)
    added = hier.bridge_s - (sub.bridge_s if sub.fits else 0.0)
    one = min(profiles[j].overhead_s + profiles[j].per_sample_s for i in cpu for j in i.devices)
    if sub.fits and one > sub.compute_s:      # even its smallest share outlasts the others' step
        gain = f"even one sample takes it {_ms(one)}, longer than the {_ms(sub.compute_s)} the others compute a step"
    else:
        saved = max(0.0, sub.compute_s - hier.compute_s) if hier.fits and sub.fits else 0.0
        gain = f"saving {_ms(saved)} of compute a step"
    return (f"the CPU ({names}) is left out: its share would be {share} of {b} samples ({share / b:.1%}), {gain}, "
            f"while the bridge round it adds costs {_ms(added)}" + offload)
