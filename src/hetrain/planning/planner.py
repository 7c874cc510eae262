"""The planner: a frozen Plan from device profiles and a global batch. Pure: no torch, no processes.

What it decides, per device: the share of the global batch (integers summing exactly to it), the
micro-batch size and count (memory), activation checkpointing (only when one sample does not fit
without it, and then of the fewest blocks that fit: options.fit), and — when allowed — leaving a device out (too slow to help, or too small for one
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

A device may have a largest share (PlanOptions.share_caps: a gathered-state rank that must not
accumulate, savers.dp_plan) and its optimizer state in host memory (offload_ranks: recorded in
its DevicePlan; its profile's optimizer_s already holds the cost, savers.with_state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.units import format_bytes
from .baseline import ddp_equal_split
from .cost import Assignment, StepCost, standalone, step_cost
from .options import PlanOptions, does_not_fit, fit, ring_link
from .plan import DevicePlan, ExcludedDevice, Plan
from .profile import DeviceProfile
from .shares import StepTime, solve_shares

MAX_OPT_LEVELS = 24        # optimizer-time thresholds tried exactly; more are sampled
MAX_EXPLAINED = 8          # left-out devices whose reason is costed in full (one re-plan each)
# How the one reason a user acts on begins: a device kept although the plan is faster without it
# (relaunch without it). The runtime's compact plan shows it (runtime/measure/joint.show_plan);
# every other reason waits for --verbose.
KEPT_TOO_SLOW = "too slow to help: without"


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


def _assignments(profiles, fits, shares: dict[int, int]) -> list[Assignment]:
    return [Assignment(profile=profiles[i], share=s, micro_batch=min(fits[i].micro, s),
                       checkpointing=fits[i].checkpointing, checkpoint_blocks=fits[i].checkpoint_blocks)
            for i, s in sorted(shares.items())]


def _cost(profiles, fits, shares, o: PlanOptions) -> StepCost:
    members = [profiles[i] for i in sorted(shares)]
    return step_cost(_assignments(profiles, fits, shares), global_batch=o.global_batch,
                     grad_bytes=o.grad_bytes, link=ring_link(members, o),
                     sync_s=o.sync_s if len(members) > 1 else None,
                     agree_s=o.agree_s if len(members) > 1 else 0.0, synced=len(members) > 1)


def _host(profiles):
    """What the devices share (DeviceProfile.host; cost.py), or None."""
    return next((p.host for p in profiles if p.host is not None), None)


def _ddp_cost(profiles) -> float:
    host = _host(profiles)
    return host.ddp_cost if host is not None else 1.0


def _factors(shares: dict[int, int], cost: StepCost) -> dict[int, float]:
    """Each member's slowdown from sharing host cores, by device index."""
    return dict(zip(sorted(shares), cost.stretch_by_device))


def _devs(profiles, fits, indices, factors: dict[int, float], ddp_cost: float = 1.0,
          batch: int | None = None, caps: Sequence[int | None] = ()) -> list[_Dev]:
    out = []
    for i in indices:
        limit = caps[i] if i < len(caps) else None
        p, f = profiles[i], fits[i]
        g = factors.get(i, 1.0)
        k = g * p.recompute(**f.ckpt)
        # The last micro-batch's pacing and DDP costs (cost.last_micro_extra), (K − 1) of it. A share
        # in one micro-batch whatever it is (a cap of the whole batch): exact. Under a smaller cap,
        # the cap's micro-batch: more than the last one costs when the share is not a multiple of
        # it; step_cost then costs every candidate exactly.
        extra = p.paced_cost * ddp_cost - 1
        if batch is None or f.micro >= batch:
            time = StepTime(per_sample=p.per_sample_s * k * (1 + extra), per_micro=p.overhead_s * k,
                            fixed=p.overhead_s * k * extra, micro=f.micro, limit=limit)
        else:
            time = StepTime(per_sample=p.per_sample_s * k, per_micro=p.overhead_s * k,
                            fixed=(p.overhead_s + p.per_sample_s * f.micro) * k * extra, micro=f.micro, limit=limit)
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
    host = _host(profiles)
    for _ in range(6 if host is not None and host.replan else 1):
        devs = _devs(profiles, fits, indices, factors, _ddp_cost(profiles), o.global_batch, o.share_caps)
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
    if best is None and any(c is not None for c in o.share_caps):
        raise UsageError(f"the devices that must run their share as one micro-batch take at most "
                         f"{sum(c for c in o.share_caps if c is not None)} samples, and the rest cannot take the "
                         f"remainder of {o.global_batch}", "a smaller global batch, or more memory")
    if best is None:
        raise UsageError(f"cannot split a global batch of {o.global_batch} over {len(indices)} device(s)",
                         f"use a global batch of at least {len(indices)}")
    return best


def make_plan(profiles: Sequence[DeviceProfile], options: PlanOptions) -> Plan:
    """The plan for these devices (rank order = profile order); see the module docstring.

    Complexity, for W devices of K kinds (equal profiles) and global batch B: a share solve is
    O(W + K·log B) for its water level plus O(W log K) to trim to exactly B (shares.py); the
    candidates are at most MAX_OPT_LEVELS + log2 W share maps, each solved and costed in O(W log W),
    repeated at most 6 times when devices share host cores, plus MAX_EXPLAINED re-plans for
    devices left out. In all O((MAX_OPT_LEVELS + log W)·W log W): no W² term."""
    o = options
    n = len(profiles)
    if n == 0:
        raise UsageError("no devices to plan for", "give at least one device (a cluster spec or a profile)")
    if o.global_batch < n:
        raise UsageError(
            f"global batch {o.global_batch} is smaller than the {n} devices",
            f"use a global batch of at least {n} (every device needs one sample), or fewer devices")
    caps = o.share_caps
    fits = [fit(p, o, want=caps[i] if i < len(caps) and caps[i] else 1) for i, p in enumerate(profiles)]
    misfits = [i for i in range(n) if fits[i].micro == 0]
    excluded: dict[int, ExcludedDevice] = {}
    if len(misfits) == n:        # explain with the device that has the most memory
        largest = max(misfits, key=lambda i: profiles[i].memory_bytes or 0)
        what, fix = does_not_fit(profiles[largest], o)
        raise UsageError("the model fits on no device" + (", not even the largest: " if n > 1 else ": ") + what,
                         fix)
    for i in misfits:
        what, fix = does_not_fit(profiles[i], o)
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
            note = (f"{KEPT_TOO_SLOW} {', '.join(profiles[i].device for i in left_out)} the step "
                    f"would be {free_cost.step_s * 1e3:.1f} ms ({free_cost.samples_per_s:.1f} samples/s, vs "
                    f"{cost.samples_per_s:.1f}); kept because its process is running — relaunch without it")
            drag = {i: note for i in left_out}
    return _build(profiles, fits, shares, cost, excluded, o, drag)


def _explain_slow(profiles, fits, shares, cost: StepCost, i: int, o: PlanOptions, *,
                  replan: bool) -> ExcludedDevice:
    p = profiles[i]
    devs = _devs(profiles, fits, sorted([*shares, i]), _factors(shares, cost), _ddp_cost(profiles), o.global_batch,
                 o.share_caps)
    with_it = _solve(devs, o.global_batch, forced=True) if replan else None
    t1 = p.micro_seconds(1, **fits[i].ckpt)
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
    best_rate = {i: profiles[i].samples_per_s(min(fits[i].micro, shares[i]), **fits[i].ckpt) for i in members}
    top = max(best_rate.values())
    standalone_sum = sum(standalone(p, global_batch=B, margin=o.memory_margin, micro_cap=o.micro_batch_cap,
                                    checkpointing=fits[i].checkpointing, blocks=fits[i].checkpoint_blocks)
                         for i, p in enumerate(profiles))
    single = max(standalone(p, global_batch=B, margin=o.memory_margin, micro_cap=o.micro_batch_cap,
                            checkpointing=fits[i].checkpointing, blocks=fits[i].checkpoint_blocks)
                 for i, p in enumerate(profiles) if fits[i].micro)
    plans = []
    for rank, i in enumerate(members):
        p, f, share = profiles[i], fits[i], shares[i]
        a = Assignment(profile=p, share=share, micro_batch=min(f.micro, share), checkpointing=f.checkpointing,
                       checkpoint_blocks=f.checkpoint_blocks)
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
            reasons.append("activation checkpointing on "
                           + (f"{f.checkpoint_blocks} of {p.blocks} blocks (the fewest that fit)"
                              if f.checkpoint_blocks is not None else "every block")
                           + f": one sample does not fit without it (compute ×{p.recompute(**f.ckpt):.2f})")
        if i in o.offload_ranks:
            reasons.append(f"optimizer state in host memory (offload, to fit): its step takes {p.optimizer_s * 1e3:.1f} "
                           "ms over the host link and on the host's CPU")
        mem = a.memory_bytes()
        reasons.append(f"predicted peak memory {format_bytes(mem)}"
                       + (f" of {format_bytes(p.memory_bytes)}" if p.memory_bytes else ""))
        if i in drag:
            reasons.append(drag[i])
        plans.append(DevicePlan(
            rank=rank, device=p.device, speed=best_rate[i] / top, share=share, micro_batch=micro,
            precision=p.precision, checkpointing=f.checkpointing, checkpoint_blocks=f.checkpoint_blocks,
            offload_optimizer=i in o.offload_ranks,
            memory_cap_bytes=p.memory_bytes,
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
    host = _host(profiles)
    if host is not None:
        predicted.update(host.predicted(cost))
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
    if host is not None:
        notes += host.notes(cost)
    paced, ddp_cost = max((profiles[i].paced_cost for i in members), default=1.0), _ddp_cost(profiles)
    if ddp_cost >= 1.005 or paced >= 1.005:
        notes.append("a step's last micro-batch costs more CPU than its profile's flat-out passes: "
                     + ", ".join(filter(None, (f"×{paced:.3f} paced (a backward after a paced sleep, measured)"
                                               if paced >= 1.005 else "",
                                               f"×{ddp_cost:.3f} through DDP (its hooks and bucket copies, "
                                               "measured beside the bare module)" if ddp_cost >= 1.005 else ""))))
    if len(profiles) > 1:
        notes.append(f"plain DDP equal split: {ddp.samples_per_s:.1f} samples/s ({ddp_why})" if ddp
                     else f"plain DDP equal split cannot run: {ddp_why}")
    if drag:
        notes.append(next(iter(drag.values())))
    return Plan(global_batch=B, devices=tuple(plans), note="; ".join(notes), predicted=predicted,
                excluded=tuple(excluded[i] for i in sorted(excluded)))
