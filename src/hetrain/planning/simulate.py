"""Strategies side by side on a cluster that need not exist: the fastest single device, plain DDP
with an equal split, and hetrain's plan. Pure: profiles in, predictions and reasons out.

Efficiency is throughput ÷ Σ standalone throughputs (each device training alone on the whole
global batch): the physical limit of data parallelism. The answers it gives in words: what each
device adds (the plan's throughput with and without it), and which device — or the link — sets
the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..hardware.cluster import ClusterDevice
from ..hardware.units import compact, device_kinds, format_bytes
from .collectives import Link
from .cost import DEFAULT_EFFICIENCY, PCIE_GBS, Assignment, catalog_link, estimate_profile, peak_flops, standalone
from .plan import Plan
from .baseline import ddp_equal_split
from .options import PlanOptions, ring_link
from .planner import make_plan
from .profile import DeviceProfile, ModelSpec

RATIOS = ("spec", "peak")
MARGINAL_MAX_DEVICES = 16        # 'what each device adds' re-plans once per device
MANY_LINES = 8                   # beyond this many devices left out: one answer per kind


@dataclass(frozen=True, kw_only=True)
class Strategy:
    name: str
    samples_per_s: float                 # 0 when it cannot run
    efficiency: float                    # of Σ standalone samples/s
    step_s: float
    memory_per_device: tuple[dict, ...]  # {'device', 'bytes' (None: not used), 'cap'}
    why: str

    def to_dict(self) -> dict:
        return {"name": self.name, "samples_per_s": self.samples_per_s, "efficiency": self.efficiency,
                "step_s": self.step_s, "memory_per_device": [dict(m) for m in self.memory_per_device],
                "why": self.why}


@dataclass(frozen=True, kw_only=True)
class DeviceRow:
    device: str
    standalone_samples_per_s: float
    ddp_share: int
    hetrain_share: int                   # 0: excluded
    adds_samples_per_s: float | None     # hetrain with it minus without it
    note: str


@dataclass(frozen=True, kw_only=True)
class Simulation:
    global_batch: int
    strategies: tuple[Strategy, ...]
    devices: tuple[DeviceRow, ...]
    plan: Plan
    link: Link
    answers: tuple[str, ...]             # 'what does adding X buy', 'which card is the bottleneck'

    def to_dict(self) -> dict:
        return {
            "global_batch": self.global_batch,
            "strategies": [s.to_dict() for s in self.strategies],
            "devices": [vars(d).copy() for d in self.devices],
            "answers": list(self.answers),
            "link": {"bandwidth_gbs": self.link.bandwidth_gbs if math.isfinite(self.link.bandwidth_gbs) else None,
                     "source": self.link.source},
            "plan": {"shares": list(self.plan.shares), "note": self.plan.note,
                     "devices": [{"device": d.device, "share": d.share, "micro_batch": d.micro_batch,
                                  "n_micro": d.n_micro, "checkpointing": d.checkpointing,
                                  "checkpoint_blocks": d.checkpoint_blocks, "offload_optimizer": d.offload_optimizer,
                                  "reasons": list(d.reasons)} for d in self.plan.devices],
                     "excluded": [vars(e).copy() for e in self.plan.excluded]},
        }


def cluster_profiles(cluster: Sequence[ClusterDevice], model: ModelSpec, *, precision: str = "bf16",
                     efficiency: float = DEFAULT_EFFICIENCY, ratios: str = "spec",
                     optimizer: str = "adamw") -> list[DeviceProfile]:
    """Catalog estimates for each device of a cluster spec. ratios='spec': the fastest device runs
    at `efficiency` × its peak and the others at their speed in the spec relative to it (the
    catalog's speed index, from training benchmarks, unless the spec gives one — the ratios a
    cluster spec means everywhere); ratios='peak': every device at `efficiency` × its own peak."""
    if ratios not in RATIOS:
        from ..errors import UsageError

        raise UsageError(f"unknown speed ratios {ratios!r}", f"use one of {RATIOS}")
    anchor = max(cluster, key=lambda d: d.speed)
    ring = catalog_link([d.gpu for d in cluster])
    nvlink = ring.source.startswith("NVLink")
    anchor_peak, anchor_why = peak_flops(anchor.gpu, precision)
    out = []
    for d in cluster:
        if ratios == "spec":
            flops = anchor_peak * efficiency * d.speed / anchor.speed     # the fastest at efficiency × its peak
            why = (f"{efficiency:.0%} of {anchor.gpu.key}'s {anchor_why}" if d is anchor or d.speed == 1.0
                   else f"{d.speed:.2f} × {anchor.gpu.key}'s ({d.speed_source})")
        else:
            peak, peak_why = peak_flops(d.gpu, precision)
            flops, why = peak * efficiency, f"{efficiency:.0%} of {peak_why}"
        profile = estimate_profile(model, d.gpu, label=d.label, precision=precision, efficiency=efficiency,
                                   flops_per_s=flops, flops_reason=why, memory_bytes=d.memory_bytes,
                                   optimizer=optimizer)
        # Each device's own link; the ring runs at the slowest of those taking part.
        link = ring.bandwidth_gbs if nvlink else PCIE_GBS.get(d.gpu.pcie_gen, PCIE_GBS[3])
        out.append(replace(profile, link_gbs=link))
    return out


def _memory(profiles, assignments: dict[int, Assignment]) -> tuple[dict, ...]:
    return tuple({"device": p.device, "bytes": int(assignments[i].memory_bytes()) if i in assignments else None,
                  "cap": p.memory_bytes} for i, p in enumerate(profiles))


def simulate(profiles: Sequence[DeviceProfile], *, global_batch: int, grad_bytes: float, link: Link | None = None,
             memory_margin: float = 0.10, allow_checkpointing: bool = True) -> Simulation:
    """Predict the three strategies on these devices."""
    options = PlanOptions(global_batch=global_batch, grad_bytes=grad_bytes, link=link,
                          memory_margin=memory_margin, allow_checkpointing=allow_checkpointing)
    plan = make_plan(profiles, options)
    B, pred = global_batch, plan.predicted
    alone = [standalone(p, global_batch=B, margin=memory_margin) for p in profiles]
    alone_ckpt = [standalone(p, global_batch=B, margin=memory_margin, checkpointing=True) if allow_checkpointing
                  else 0.0 for p in profiles]
    alone = [max(a, c) for a, c in zip(alone, alone_ckpt)]
    total = sum(alone)
    eff = (lambda sps: sps / total if total else 0.0)

    # Fastest single device.
    best = max(range(len(profiles)), key=lambda i: alone[i])
    p = profiles[best]
    ckpt = alone_ckpt[best] > 0 and alone_ckpt[best] >= alone[best] and p.max_micro_batch(margin=memory_margin) == 0
    cap = p.max_micro_batch(margin=memory_margin, checkpointing=ckpt)
    single_a = Assignment(profile=p, share=B, micro_batch=B if cap is None else min(cap, B), checkpointing=ckpt)
    single = Strategy(
        name="fastest single device", samples_per_s=alone[best], efficiency=eff(alone[best]),
        step_s=B / alone[best] if alone[best] else math.inf, memory_per_device=_memory(profiles, {best: single_a}),
        why=(f"{p.device} alone: {single_a.micro_batch} x{single_a.n_micro} micro-batches, no communication"))

    # Plain DDP, equal split.
    ddp_pred = ddp_equal_split(profiles, options)
    ddp = ddp_pred.cost
    if ddp is not None:
        idle = 1 - min(ddp.compute_s) / max(ddp.compute_s)
        ddp_strategy = Strategy(name="plain DDP equal split", samples_per_s=ddp.samples_per_s,
                                efficiency=eff(ddp.samples_per_s), step_s=ddp.step_s,
                                memory_per_device=_memory(profiles, dict(enumerate(ddp_pred.assignments))),
                                why=f"{ddp_pred.why}; the fastest device idles {idle:.0%} of each step")
        ddp_shares = [a.share for a in ddp_pred.assignments]
    else:
        ddp_strategy = Strategy(name="plain DDP equal split", samples_per_s=0.0, efficiency=0.0, step_s=math.inf,
                                memory_per_device=_memory(profiles, {}), why=f"cannot run: {ddp_pred.why}")
        ddp_shares = [0] * len(profiles)

    # hetrain.
    index = {d.device: i for i, d in enumerate(profiles)}
    het_assign = {index[d.device]: Assignment(profile=profiles[index[d.device]], share=d.share,
                                              micro_batch=d.micro_batch, checkpointing=d.checkpointing,
                                              checkpoint_blocks=d.checkpoint_blocks)
                  for d in plan.devices}
    het_why = (f"shares {compact(d.share for d in plan.devices)} by measured-or-estimated speed, "
               f"micro-batches by each device's memory")
    if plan.excluded:
        het_why += "; left out: " + compact([f"{e.device.split('#')[0]} ({e.reason.split(':')[0]})"
                                             for e in plan.excluded], sep="; ", limit=MANY_LINES)
    hetrain = Strategy(name="hetrain", samples_per_s=pred["samples_per_s"], efficiency=eff(pred["samples_per_s"]),
                       step_s=pred["step_s"], memory_per_device=_memory(profiles, het_assign), why=het_why)

    # What each device adds.
    adds: list[float | None] = [None] * len(profiles)
    if 1 < len(profiles) <= MARGINAL_MAX_DEVICES:
        for i in range(len(profiles)):
            rest = [q for j, q in enumerate(profiles) if j != i]
            if B < len(rest):
                continue
            try:
                without = make_plan(rest, options).predicted["samples_per_s"]
            except Exception:   # noqa: BLE001 — the model may fit nowhere without it
                without = 0.0
            adds[i] = pred["samples_per_s"] - without
    excluded = {e.device: e for e in plan.excluded}
    rows = []
    for i, q in enumerate(profiles):
        share = next((d.share for d in plan.devices if d.device == q.device), 0)
        note = ""
        if q.device in excluded:
            note = ("left out: does not fit one sample" if excluded[q.device].kind == "memory"
                    else "left out: too slow to help")
        rows.append(DeviceRow(device=q.device, standalone_samples_per_s=alone[i], ddp_share=ddp_shares[i],
                              hetrain_share=share, adds_samples_per_s=adds[i], note=note))

    answers = _answers(profiles, alone, best, single, ddp_strategy, hetrain, ddp, plan, adds)
    members = [profiles[index[d.device]] for d in plan.devices]
    return Simulation(global_batch=B, strategies=(single, ddp_strategy, hetrain), devices=tuple(rows),
                      plan=plan, link=ring_link(members, options), answers=tuple(answers))


def _answers(profiles, alone, best, single, ddp_s, het, ddp, plan, adds) -> list[str]:
    out = []
    name = profiles[best].device
    others = [p.device for i, p in enumerate(profiles) if i != best]
    if others and single.samples_per_s:
        line = (f"adding {device_kinds(others)} to {name}: hetrain ×{het.samples_per_s / single.samples_per_s:.2f} "
                f"({het.samples_per_s - single.samples_per_s:+.1f} samples/s)")
        if ddp_s.samples_per_s:
            line += f", plain DDP ×{ddp_s.samples_per_s / single.samples_per_s:.2f}"
        else:
            line += ", plain DDP cannot run"
        out.append(line)
    if any(a is not None for a in adds):
        out.append("each device adds (hetrain, with vs without it): " + ", ".join(
            f"{p.device} {a:+.1f} samples/s" for p, a in zip(profiles, adds) if a is not None))
    if ddp is not None and len(profiles) > 1:
        slow = profiles[ddp.bottleneck]
        caps = [(p.max_micro_batch(margin=0.1), p) for p in profiles]
        limited = [c for c in caps if c[0] is not None]
        mem = f"; the smallest memory ({min(limited, key=lambda c: c[0])[1].device}) caps every device's " \
              f"micro-batch" if limited and min(c[0] for c in limited) < plan.global_batch // len(profiles) else ""
        out.append(f"bottleneck under plain DDP: {slow.device} — every step waits "
                   f"{max(ddp.compute_s) * 1e3:.1f} ms for it while the fastest device is done in "
                   f"{min(ddp.compute_s) * 1e3:.1f} ms{mem}")
    pred = plan.predicted
    members = plan.devices
    if members:
        crit = max(members, key=lambda d: d.predicted_compute_s or 0.0)
        exposed = pred.get("comm_exposed_s", 0.0)
        if exposed > 0.2 * pred["step_s"]:
            out.append(f"bottleneck under hetrain: communication — {exposed * 1e3:.1f} ms of each "
                       f"{pred['step_s'] * 1e3:.1f} ms step is exposed gradient sync; a faster link or a larger "
                       "global batch helps")
        elif len(members) > 1:
            out.append(f"under hetrain every device finishes together (compute {crit.predicted_compute_s * 1e3:.1f} "
                       f"ms, set by {crit.device}); exposed sync {exposed * 1e3:.1f} ms, optimizer "
                       f"{pred['optimizer_s'] * 1e3:.1f} ms")
    if len(plan.excluded) <= MANY_LINES:
        for e in plan.excluded:
            out.append(f"{e.device} is left out: {e.reason}; {e.fix}")
    else:                    # one line per kind of device left out, its first reason as the example
        kinds: dict[str, list] = {}
        for e in plan.excluded:
            kinds.setdefault(e.device.split("#")[0], []).append(e)
        for kind, left in kinds.items():
            out.append(f"{len(left)} {kind} devices are left out, e.g. {left[0].device}: {left[0].reason}; {left[0].fix}")
    return out


def describe_memory(entry: dict) -> str:
    if entry["bytes"] is None:
        return "-"
    return format_bytes(entry["bytes"]) + (f"/{format_bytes(entry['cap'])}" if entry["cap"] else "")
