"""The planner: a frozen Plan from device profiles and a global batch. Pure: no torch, no processes.

What it decides, per device: the share of the global batch (integers summing exactly to it), the
micro-batch size and count (memory), activation checkpointing (only when one sample does not fit
without it), and — when allowed — leaving a device out (too slow to help, or too small for one
sample even with checkpointing), with the reason and what would bring it in. It predicts the step
time and throughput of the plan and of plain equal-split DDP on the same devices.

How. With t_r(s) the compute seconds of device r for a share of s samples (micro-batches of at
most m_r samples: ⌈s/m_r⌉·a_r + b_r·s), the compute part of a step is max_r t_r(s_r). Its minimum
over integer shares is found exactly by the share solver (shares.py: a water level by bisection,
then trimmed to exactly B from the devices that finish last). When devices may be left out, a
device takes part iff its first sample ends by then (adding it can then only help); the
optimizer step (max over devices) is handled by sweeping the threshold on optimizer time, and
communication by also trying the fastest k devices (k = 1, 2, 4, …): each candidate set is
costed in full (cost.py) and the fastest kept. Without communication this is the exact optimum
over all subsets, so more devices are never predicted slower than fewer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.units import format_bytes
from .collectives import FREE_LINK, Link
from .cost import Assignment, StepCost, standalone, step_cost
from .plan import DevicePlan, ExcludedDevice, Plan, split_evenly
from .profile import DeviceProfile
from .shares import StepTime, solve_shares

MAX_OPT_LEVELS = 24        # optimizer-time thresholds tried exactly; more are sampled
MAX_EXPLAINED = 8          # left-out devices whose reason is costed in full (one re-plan each)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What the planner is asked; every error names the fix."""

    global_batch: int
    grad_bytes: float = 0.0              # bytes all-reduced per step (fp32 gradients)
    link: Link | None = None             # slowest link; None: from the profiles' link_gbs, else not modelled
    memory_margin: float = 0.10          # fraction of each device's memory kept free
    micro_batch_cap: int | None = None   # cap on every micro-batch
    allow_exclusion: bool = True         # False: every device takes >= 1 sample (its process is running)
    allow_checkpointing: bool = True     # False while the runtime cannot checkpoint activations
    sync_s: float | None = None          # measured exposed gradient sync per step (replaces the ring model)
    agree_s: float = 0.0                 # hetrain's per-step agreement all-reduce, measured (not plain DDP's)
    straggle: float = 0.0                # how far the last device trails the average, measured (cost.py)
    straggle_stretch: float = 1.0        # the host-core contention `straggle` was measured under
    host_cores: float | None = None      # cores shared by devices with cpu_share > 0 (emulation)
    host_load: float = 0.0               # other runnable processes on those cores (measured or 0)

    def __post_init__(self) -> None:
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise UsageError(f"global batch {self.global_batch!r} must be a positive integer",
                             "give the samples per optimizer step over all devices, e.g. --global-batch 256")
        if not (self.grad_bytes >= 0 and math.isfinite(self.grad_bytes)):
            raise UsageError(f"gradient bytes {self.grad_bytes!r}", "give the bytes all-reduced per step, >= 0")
        if not 0 <= self.memory_margin < 1:
            raise UsageError(f"memory margin {self.memory_margin!r}", "use a fraction in [0, 1), e.g. 0.1")
        if self.micro_batch_cap is not None and self.micro_batch_cap < 1:
            raise UsageError(f"micro-batch cap {self.micro_batch_cap}", "use a positive cap, or none")
        if self.sync_s is not None and not (self.sync_s >= 0 and math.isfinite(self.sync_s)):
            raise UsageError(f"sync seconds {self.sync_s!r}", "give the measured exposed sync, >= 0, or none")
        if not (self.agree_s >= 0 and math.isfinite(self.agree_s)):
            raise UsageError(f"agreement seconds {self.agree_s!r}", "give the measured per-step agreement, >= 0")
        if not (0 <= self.straggle < 10) or not self.straggle_stretch >= 1:
            raise UsageError(f"straggle {self.straggle!r} at contention {self.straggle_stretch!r}",
                             "give a measured fraction >= 0 and a contention >= 1 (or leave both out)")
        if self.host_cores is not None and not self.host_cores > 0:
            raise UsageError(f"host cores {self.host_cores}", "give the host's core count, or none")
        if not self.host_load >= 0:
            raise UsageError(f"host load {self.host_load}", "give the other runnable processes, >= 0")


@dataclass(frozen=True)
class _Dev:
    """One device as the share solver sees it: stretched, checkpointing applied."""

    index: int
    time: StepTime    # compute seconds for a share
    opt: float        # optimizer seconds

    def t(self, s: int) -> float:
        return self.time.seconds(s)


def _solve(devs: Sequence[_Dev], batch: int, *, forced: bool) -> dict[int, int] | None:
    """Integer shares minimising max t_r(s_r), summing to `batch`, of the devices taking part.
    forced: every device >= 1; else a device takes part only if that helps. None if impossible."""
    devs = sorted(devs, key=lambda d: d.index)      # ties go to the lower device index, not list order
    shares = solve_shares(batch, [d.time for d in devs], minimum=1 if forced else 0)
    return None if shares is None else {d.index: s for d, s in zip(devs, shares) if s > 0}


@dataclass(frozen=True, kw_only=True)
class _Fit:
    """How a device fits in memory: micro-batch cap and checkpointing, or why it cannot."""

    micro: int                # cap on its micro-batch (>= 1), or 0 when it cannot fit one sample
    checkpointing: bool
    memory_reason: str
    memory_cap: int | None = None   # the cap memory alone sets (None: memory does not limit it)


def _fit(p: DeviceProfile, o: PlanOptions) -> _Fit:
    margin = o.memory_margin
    cap = p.max_micro_batch(margin=margin)
    ckpt = False
    if cap == 0 and o.allow_checkpointing:
        cap_c = p.max_micro_batch(margin=margin, checkpointing=True)
        if cap_c != 0:
            cap, ckpt = cap_c, True
    limit = o.global_batch
    if o.micro_batch_cap is not None:
        limit = min(limit, o.micro_batch_cap)
    if p.memory_bytes is None:
        why = "memory not capped"
    else:
        why = (f"{format_bytes(p.memory_bytes)} memory, {format_bytes(p.fixed_bytes)} model state, "
               f"{format_bytes(p.activation_bytes_per_sample)}/sample"
               + (f" + {format_bytes(p.activation_fixed_bytes)}/micro-batch" if p.activation_fixed_bytes else "")
               + (f" (×{p.checkpoint_fraction:.2g} with activation checkpointing)" if ckpt else "")
               + f", {margin:.0%} kept free")
    if cap == 0:
        return _Fit(micro=0, checkpointing=False, memory_reason=why)
    micro = limit if cap is None else min(cap, limit)
    if o.micro_batch_cap is not None and (cap is None or o.micro_batch_cap < cap):
        why = f"micro-batch cap {o.micro_batch_cap} given ({why})"
    return _Fit(micro=micro, checkpointing=ckpt, memory_reason=why, memory_cap=cap)


def _does_not_fit(p: DeviceProfile, o: PlanOptions) -> tuple[str, str]:
    """Why a device cannot take one sample, and what would make it fit."""
    margin = o.memory_margin
    need = p.memory_needed(1)
    need_c = p.memory_needed(1, checkpointing=True)
    have = p.memory_bytes * (1 - margin)
    what = (f"{p.device}: one sample needs {format_bytes(need)} ({format_bytes(p.fixed_bytes)} model state "
            f"+ {format_bytes(need - p.fixed_bytes)} activations) but {format_bytes(have)} is usable "
            f"({format_bytes(p.memory_bytes)}, {margin:.0%} kept free)")
    if p.fixed_bytes >= have:
        fix = (f"the model state alone ({format_bytes(p.fixed_bytes)}: parameters, gradients, optimizer state) "
               f"exceeds it: shard it across devices (FSDP/ZeRO), use a smaller optimizer state, or a device "
               f"with ≥ {format_bytes(need_c / (1 - margin))}")
    elif o.allow_checkpointing:
        fix = (f"even with activation checkpointing it needs {format_bytes(need_c)}: a device with ≥ "
               f"{format_bytes(need_c / (1 - margin))}, a shorter sequence or smaller input, or sharding")
    else:
        fix = (f"activation checkpointing would need {format_bytes(need_c)}"
               + (" (fits)" if need_c <= have else "")
               + f"; or a device with ≥ {format_bytes(need / (1 - margin))}, or a smaller input")
    return what, fix


def ring_link(profiles: Sequence[DeviceProfile], o: PlanOptions) -> Link:
    """The ring's slowest link: as given, else the slowest of the devices' own links, else free."""
    if o.link is not None:
        return o.link
    given = [p for p in profiles if p.link_gbs]
    if given and len(given) == len(profiles):
        slow = min(given, key=lambda p: p.link_gbs)
        return Link(bandwidth_gbs=slow.link_gbs, source=f"slowest device link: {slow.device}'s")
    return FREE_LINK


def _assignments(profiles, fits, shares: dict[int, int]) -> list[Assignment]:
    return [Assignment(profile=profiles[i], share=s, micro_batch=min(fits[i].micro, s),
                       checkpointing=fits[i].checkpointing) for i, s in sorted(shares.items())]


def _cost(profiles, fits, shares, o: PlanOptions) -> StepCost:
    members = [profiles[i] for i in sorted(shares)]
    return step_cost(_assignments(profiles, fits, shares), global_batch=o.global_batch,
                     grad_bytes=o.grad_bytes, link=ring_link(members, o), host_cores=o.host_cores,
                     host_load=o.host_load, sync_s=o.sync_s if len(members) > 1 else None,
                     agree_s=o.agree_s if len(members) > 1 else 0.0, straggle=o.straggle,
                     straggle_stretch=o.straggle_stretch)


def _factors(shares: dict[int, int], cost: StepCost) -> dict[int, float]:
    """Each member's slowdown from sharing host cores, by device index."""
    return dict(zip(sorted(shares), cost.stretch_by_device))


def _devs(profiles, fits, indices, factors: dict[int, float]) -> list[_Dev]:
    out = []
    for i in indices:
        p, f = profiles[i], fits[i]
        g = factors.get(i, 1.0)
        k = g * (p.recompute_factor if f.checkpointing else 1.0)
        time = StepTime(per_sample=p.per_sample_s * k, per_micro=p.overhead_s * k, micro=f.micro)
        out.append(_Dev(index=i, time=time, opt=p.optimizer_s * g))
    return out


def _candidates(devs: list[_Dev], batch: int, forced: bool) -> list[dict[int, int]]:
    """Share maps worth costing in full (see the module docstring)."""
    if forced:
        s = _solve(devs, batch, forced=True)
        return [s] if s else []
    out = []
    levels = sorted({d.opt for d in devs}, reverse=True)
    if len(levels) > MAX_OPT_LEVELS:
        step = (len(levels) - 1) / (MAX_OPT_LEVELS - 1)
        levels = sorted({levels[round(k * step)] for k in range(MAX_OPT_LEVELS)}, reverse=True)
    best = math.inf
    for level in levels:
        members = [d for d in devs if d.opt <= level]
        s = _solve(members, batch, forced=False)
        if s is None:
            continue
        compute = max(d.t(s.get(d.index, 0)) for d in members)
        if compute >= best:
            break        # smaller sets cannot compute faster; the optimizer term only shrinks by level
        best = min(best, compute + max(d.opt for d in members if d.index in s))
        out.append(s)
    # Communication grows with the ring: also try the fastest k devices alone.
    by_speed = sorted(devs, key=lambda d: (d.t(batch) + d.opt, d.index))
    k = 1
    while k < len(by_speed):
        s = _solve(by_speed[:k], batch, forced=False)
        if s:
            out.append(s)
        k *= 2
    return out


def _choose(profiles, fits, indices, o: PlanOptions, forced: bool) -> tuple[dict[int, int], StepCost]:
    """The best share map over `indices`. With devices sharing host cores, their slowdowns depend
    on the split: split by the slowdowns of the last candidate, cost the new split, repeat, and
    keep the fastest seen."""
    factors: dict[int, float] = {}
    best = None
    for _ in range(6 if o.host_cores else 1):
        devs = _devs(profiles, fits, indices, factors)
        scored = [(_cost(profiles, fits, s, o), s) for s in _candidates(devs, o.global_batch, forced)]
        if not scored:
            break
        cost, shares = min(scored, key=lambda cs: (cs[0].step_s, -len(cs[1])))
        if best is None or cost.step_s < best[1].step_s:
            best = (shares, cost)
        new = _factors(shares, cost)
        if all(abs(new.get(i, 1.0) - factors.get(i, 1.0)) < 1e-3 for i in indices):
            break
        factors = new
    if best is None:
        raise UsageError(f"cannot split a global batch of {o.global_batch} over {len(indices)} device(s)",
                         f"use a global batch of at least {len(indices)}")
    return best


@dataclass(frozen=True, kw_only=True)
class DDPPrediction:
    """Plain DDP on every device: equal shares, one micro-batch size for all."""

    cost: StepCost | None            # None: it cannot run
    assignments: tuple[Assignment, ...]
    why: str


def ddp_equal_split(profiles: Sequence[DeviceProfile], o: PlanOptions) -> DDPPrediction:
    """Plain DDP on every device: equal shares, the same micro-batch everywhere (the smallest
    device's), no exclusions; checkpointing everywhere if a device needs it for one sample."""
    n = len(profiles)
    if o.global_batch < n:
        return DDPPrediction(cost=None, assignments=(), why=f"global batch {o.global_batch} < {n} devices")
    shares = split_evenly(o.global_batch, n)
    caps = [p.max_micro_batch(margin=o.memory_margin) for p in profiles]
    ckpt = False
    if any(c == 0 for c in caps) and o.allow_checkpointing:
        caps = [p.max_micro_batch(margin=o.memory_margin, checkpointing=True) for p in profiles]
        ckpt = True
    if any(c == 0 for c in caps):
        small = profiles[caps.index(0)].device
        return DDPPrediction(cost=None, assignments=(), why=(
            f"{small} cannot fit one sample, and plain DDP runs the same batch on every device"))
    micro = min([shares[0]] + [c for c in caps if c is not None]
                + ([o.micro_batch_cap] if o.micro_batch_cap else []))
    assignments = tuple(Assignment(profile=p, share=s, micro_batch=min(micro, s), checkpointing=ckpt)
                        for p, s in zip(profiles, shares))
    cost = step_cost(assignments, global_batch=o.global_batch, grad_bytes=o.grad_bytes,
                     link=ring_link(profiles, o), host_cores=o.host_cores, host_load=o.host_load,
                     sync_s=o.sync_s if n > 1 else None, straggle=o.straggle, straggle_stretch=o.straggle_stretch)
    why = (f"{shares[0]} samples per device in micro-batches of {micro} (the smallest device's)"
           + (" with activation checkpointing" if ckpt else "")
           + f", so every step waits for {profiles[cost.bottleneck].device}")
    return DDPPrediction(cost=cost, assignments=assignments, why=why)


def make_plan(profiles: Sequence[DeviceProfile], options: PlanOptions) -> Plan:
    """The plan for these devices (rank order = profile order); see the module docstring."""
    o = options
    n = len(profiles)
    if n == 0:
        raise UsageError("no devices to plan for", "give at least one device (a cluster spec or a profile)")
    if o.global_batch < n:
        raise UsageError(
            f"global batch {o.global_batch} is smaller than the {n} devices",
            f"use a global batch of at least {n} (every device needs one sample), or fewer devices")
    fits = [_fit(p, o) for p in profiles]
    misfits = [i for i in range(n) if fits[i].micro == 0]
    excluded: dict[int, ExcludedDevice] = {}
    if len(misfits) == n:        # explain with the device that has the most memory
        largest = max(misfits, key=lambda i: profiles[i].memory_bytes or 0)
        what, fix = _does_not_fit(profiles[largest], o)
        raise UsageError("the model fits on no device" + (", not even the largest: " if n > 1 else ": ") + what,
                         fix)
    for i in misfits:
        what, fix = _does_not_fit(profiles[i], o)
        if not o.allow_exclusion:
            raise UsageError(what, fix)
        excluded[i] = ExcludedDevice(device=profiles[i].device, reason="does not fit one sample: " + what,
                                     fix=fix, kind="memory")
    usable = [i for i in range(n) if i not in excluded]
    shares, cost = _choose(profiles, fits, usable, o, forced=not o.allow_exclusion)

    slow = sorted((i for i in usable if i not in shares), key=lambda i: profiles[i].per_sample_s)
    for k, i in enumerate(slow):
        excluded[i] = _explain_slow(profiles, fits, shares, cost, i, o, replan=k < MAX_EXPLAINED)
    drag: dict[int, str] = {}     # kept although too slow to help (exclusion not allowed)
    if not o.allow_exclusion and len(usable) > 1:
        free_shares, free_cost = _choose(profiles, fits, usable, o, forced=False)
        if free_cost.step_s < cost.step_s * 0.98:
            left_out = [i for i in usable if i not in free_shares]
            note = (f"too slow to help: without {', '.join(profiles[i].device for i in left_out)} the step "
                    f"would be {free_cost.step_s * 1e3:.1f} ms ({free_cost.samples_per_s:.1f} samples/s, vs "
                    f"{cost.samples_per_s:.1f}); kept because its process is running — relaunch without it")
            drag = {i: note for i in left_out}
    return _build(profiles, fits, shares, cost, excluded, o, drag)


def _explain_slow(profiles, fits, shares, cost: StepCost, i: int, o: PlanOptions, *,
                  replan: bool) -> ExcludedDevice:
    p = profiles[i]
    with_it = _solve(_devs(profiles, fits, sorted([*shares, i]), _factors(shares, cost)), o.global_batch,
                     forced=True) if replan else None
    t1 = p.micro_seconds(1, checkpointing=fits[i].checkpointing)
    if with_it:
        c = _cost(profiles, fits, with_it, o)
        reason = (f"too slow to help: with it the step is {c.step_s * 1e3:.1f} ms ({c.samples_per_s:.1f} "
                  f"samples/s), without it {cost.step_s * 1e3:.1f} ms ({cost.samples_per_s:.1f} samples/s)")
    else:
        reason = (f"too slow to help: one sample takes it {t1 * 1e3:.1f} ms and its optimizer step "
                  f"{p.optimizer_s * 1e3:.1f} ms, against a step of {cost.step_s * 1e3:.1f} ms without it")
    need = max(t1 / max(cost.critical_compute_s, 1e-12), p.optimizer_s / max(cost.optimizer_s, 1e-12))
    if need > 1.0:
        fix = f"it would help at ≥ {need:.2g}× its speed (or with a larger global batch)"
    else:
        fix = "its compute would help, but one more device in the ring costs more communication: a faster link"
    return ExcludedDevice(device=p.device, reason=reason, fix=fix, kind="slow")


def _build(profiles, fits, shares, cost: StepCost, excluded, o: PlanOptions, drag: dict[int, str]) -> Plan:
    B = o.global_batch
    members = sorted(shares)
    best_rate = {i: profiles[i].samples_per_s(min(fits[i].micro, shares[i]),
                                               checkpointing=fits[i].checkpointing) for i in members}
    top = max(best_rate.values())
    standalone_sum = sum(standalone(p, global_batch=B, margin=o.memory_margin, micro_cap=o.micro_batch_cap,
                                    checkpointing=fits[i].checkpointing)
                         for i, p in enumerate(profiles))
    single = max(standalone(p, global_batch=B, margin=o.memory_margin, micro_cap=o.micro_batch_cap,
                            checkpointing=fits[i].checkpointing) for i, p in enumerate(profiles) if fits[i].micro)
    plans = []
    for rank, i in enumerate(members):
        p, f, share = profiles[i], fits[i], shares[i]
        a = Assignment(profile=p, share=share, micro_batch=min(f.micro, share), checkpointing=f.checkpointing)
        micro, n_micro = a.micro_batch, a.n_micro
        compute, slowdown = cost.compute_s[rank], cost.stretch_by_device[rank]
        reasons = [
            f"share {share}/{B}: {best_rate[i]:.1f} samples/s at micro-batch {micro} "
            f"({p.source}); compute {compute * 1e3:.1f} ms of a {cost.critical_compute_s * 1e3:.1f} ms step"
            + (f" (×{slowdown:.2f}: sharing the host's cores)" if slowdown > 1.0005 else ""),
            f"micro-batch {micro} x{n_micro}: "
            + (f.memory_reason if micro < share else f"whole share fits ({f.memory_reason})"),
        ]
        if f.checkpointing:
            reasons.append("activation checkpointing on: one sample does not fit without it "
                           f"(compute ×{p.recompute_factor:.2f})")
        mem = a.memory_bytes()
        reasons.append(f"predicted peak memory {format_bytes(mem)}"
                       + (f" of {format_bytes(p.memory_bytes)}" if p.memory_bytes else ""))
        if i in drag:
            reasons.append(drag[i])
        plans.append(DevicePlan(
            rank=rank, device=p.device, speed=best_rate[i] / top, share=share, micro_batch=micro,
            precision=p.precision, checkpointing=f.checkpointing, memory_cap_bytes=p.memory_bytes,
            reasons=tuple(reasons), predicted_compute_s=compute,
            predicted_memory_bytes=int(mem), max_micro_batch=f.memory_cap))
    ddp_pred = ddp_equal_split(profiles, o)
    ddp, ddp_why = ddp_pred.cost, ddp_pred.why
    link = ring_link([profiles[i] for i in members], o)
    predicted = {
        "step_s": cost.step_s, "samples_per_s": cost.samples_per_s,
        "compute_s": cost.critical_compute_s, "optimizer_s": cost.optimizer_s,
        "comm_s": cost.comm.total_s, "comm_overlapped_s": cost.comm.overlapped_s,
        "comm_exposed_s": cost.comm.exposed_s, "cpu_stretch": cost.stretch,
        "standalone_sum_samples_per_s": standalone_sum,
        "efficiency": cost.samples_per_s / standalone_sum if standalone_sum else 0.0,
        "best_single_samples_per_s": single,
        "ddp_step_s": ddp.step_s if ddp else 0.0,
        "ddp_samples_per_s": ddp.samples_per_s if ddp else 0.0,
        "ddp_efficiency": (ddp.samples_per_s / standalone_sum) if ddp and standalone_sum else 0.0,
        "grad_bytes": float(o.grad_bytes),
    }
    if o.sync_s is not None and len(members) > 1:
        predicted["sync_s"] = o.sync_s
    if cost.agree_s:
        predicted["agree_s"] = cost.agree_s
    if o.straggle:
        predicted.update(straggle=o.straggle, straggle_stretch=o.straggle_stretch, straggle_s=cost.straggle_s)
    if math.isfinite(link.bandwidth_gbs):
        predicted["link_gbs"] = link.bandwidth_gbs
        predicted["link_latency_s"] = link.latency_s
    notes = [f"planned: {cost.samples_per_s:.1f} samples/s predicted (step {cost.step_s * 1e3:.1f} ms = "
             f"compute {cost.critical_compute_s * 1e3:.1f} "
             + (f"+ stragglers {cost.straggle_s * 1e3:.1f} " if cost.straggle_s else "")
             + f"+ exposed sync {cost.comm.exposed_s * 1e3:.1f} "
             + (f"+ agreement {cost.agree_s * 1e3:.1f} " if cost.agree_s else "")
             + f"+ optimizer {cost.optimizer_s * 1e3:.1f}), compute set by {profiles[members[cost.bottleneck]].device}"]
    if o.sync_s is not None and len(members) > 1:
        notes.append(f"gradient sync: {o.sync_s * 1e3:.1f} ms exposed, measured through DDP at the start "
                     f"(a {link.bandwidth_gbs:.3g} GB/s all-reduce: {link.source})")
    elif cost.comm.total_s:
        notes.append(f"gradient sync {cost.comm.total_s * 1e3:.1f} ms, {cost.comm.overlapped_s * 1e3:.1f} "
                     f"overlapped with backward (link {link.bandwidth_gbs:.3g} GB/s"
                     + (f": {link.source})" if link.source else ")"))
    if cost.stretch > 1.0:
        notes.append(f"emulated devices share {o.host_cores:g} CPU cores"
                     + (f" with ~{o.host_load:.1f} other busy processes" if o.host_load else "")
                     + f": compute stretched up to ×{cost.stretch:.2f}")
    if len(profiles) > 1:
        notes.append(f"plain DDP equal split: {ddp.samples_per_s:.1f} samples/s ({ddp_why})" if ddp
                     else f"plain DDP equal split cannot run: {ddp_why}")
    if drag:
        notes.append(next(iter(drag.values())))
    return Plan(global_batch=B, devices=tuple(plans), note="; ".join(notes), predicted=predicted,
                excluded=tuple(excluded[i] for i in sorted(excluded)))
