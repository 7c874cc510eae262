"""The cost model: how long a step takes and how much memory it needs, for a given split. Pure.

Step time of data parallelism with per-device shares (one optimizer step over the global batch):

    step = max_r compute_r · (1 + straggle)  +  exposed gradient sync  +  agreement  +  max_r optimizer_r
    compute_r = n_r·a_r + b_r·share_r        (n_r micro-batches; t(m) = a + b·m per micro-batch)

Gradient sync is a ring all-reduce of the gradients, S bytes over n devices, limited by the slowest
link B: 2(n−1)/n · S/B + 2(n−1)·latency (collectives.py). DDP all-reduces bucket by bucket while
the last micro-batch's backward still runs on the slowest device, so that part of the sync is
hidden (overlapped); what is left after the backward ends — at least the last bucket — is exposed.
The agreement is hetrain's one small all-reduce per step (runtime/ranks/agree.py), measured at the
start of a job (0 when not measured, and for plain DDP, which has none).

Stragglers: every step waits for its last device, and which device is last changes from step to
step (on a shared host, whichever process the scheduler left behind), so the step is longer than
the slowest device's average. A job measures this at its start: all ranks run the same backward
at once, and `straggle` is how far the last one trails their average. That probe runs every
device flat out (contention `straggle_stretch`); a step whose devices sleep part of the time
contends less, and trails in proportion to its own stretch beyond 1 (`straggle_at`). The trail
comes from the CPU's jitter, so it is a fraction of the compute that the CPU times: all of it on a
GPU or an emulated device on the CPU's own clock (its compute is its CPU time ÷ its speed), but on
the controlled clock (`clocked`: a micro-batch lasts m·T/speed, the sleep making up what the CPU
did not take) only the last backward, which runs after the step's sleep: its CPU time, about 2/3
of its micro-batch's. Charged on the whole step there, it read the capped 1 : 0.35 pair of
benchmarks/accuracy.py (now its dp-capped row) 3-8% slower than it ran, round after round.

Compute without a profile comes from the model's FLOPs per sample and the catalog's peak at the
precision, times a stated efficiency (model FLOPs utilisation, default 40%).

Memory: parameters, gradients and optimizer state (fixed; memory.state_bytes), plus one
micro-batch's activations; activation checkpointing keeps a fraction of them and recomputes one
forward (×4/3 compute).

Emulated devices share the host's CPU cores: a device of speed s computes on the CPU for a
fraction s of its busy time and sleeps the rest, so when more devices (with whatever else the host
runs) want a core than there are cores, their compute stretches. `shared_cpu_finish` plays a step
out as the emulator runs it — every device starts together after the previous step's sync, and
computes its step, sleeping once before its last backward — with the cores shared equally among the processes
that want one (processor sharing); the planner plans with the resulting per-device slowdowns.
Devices computing at the same time on separate cores also slow each other (shared cache and
memory bandwidth: one thread's fp32 forward+backward of the demo GPT took 148 ms alone and 157-170 ms
beside a second one, on a 2-core host that was also running a benchmark). A job measures this at its start (`contention`: how much slower every device
computed in the sync probe through the bare module, all at once on `contention_at` cores, than its
profile says), and a
step's CPU segments run slower by the same measure scaled to how many compute at a time.

An emulated step's last micro-batch also costs CPU its profile's flat-out passes do not: the
throttle's sleep before its backward leaves that backward on cold caches (the profile's
`paced_cost`, measured by the profiler), and DDP's hooks and bucket copies run on the thread that
is the emulated GPU (`ddp_cost`, the CPU of the sync probe's DDP runs over its bare ones). Both
are device time the throttle charges, once a step, so `last_micro_extra` adds (paced_cost ·
ddp_cost − 1) of the last micro-batch to the device's compute (on a GPU both are 1: nothing
added). Both are ratios measured at one size (`paced_cost` with one pass's sleep before its
backward, where a step's sleep covers the whole step) and charged in proportion to the last
micro-batch: a cache refilled after a sleep may cost more like a fixed amount than a share, which
these figures cannot tell apart at the sizes measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.catalog import GpuSpec
from ..hardware.links import NVLINK_EFFICIENCY, PCIE_GBS  # noqa: F401 — PCIE_GBS: simulate imports it from here
from .collectives import Link, allreduce_seconds
from .core_sharing import cpu_rate
from .memory import state_bytes
from .plan import split_evenly
from .profile import DeviceProfile, ModelSpec

DEFAULT_EFFICIENCY = 0.40            # model FLOPs utilisation assumed for catalog estimates
DDP_BUCKET_BYTES = 25 * 1024**2      # torch DDP's default bucket_cap_mb
MICRO_OVERHEAD_S = 2e-3              # per micro-batch launch/Python cost assumed without a profile
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_ELEMENT_BYTES = 4               # DDP all-reduces fp32 gradients (autocast keeps fp32 weights)


# -- links and communication (the formulas: collectives.py) ------------------------------------
def catalog_link(gpus: Sequence[GpuSpec]) -> Link:
    """The slowest link of a ring over these cards, from the catalog: NVLink only when every card is
    the same NVLink model (mixed models cannot bridge), else PCIe at the oldest generation."""
    keys = {g.key for g in gpus}
    if len(keys) == 1 and gpus[0].nvlink_gbs > 0 and (gpus[0].datacenter or len(gpus) == 2):
        g = gpus[0]
        return Link(bandwidth_gbs=g.nvlink_gbs * NVLINK_EFFICIENCY,
                    source=f"NVLink between {g.key} cards: {NVLINK_EFFICIENCY:.0%} of {g.nvlink_gbs:g} GB/s")
    gen = min(g.pcie_gen for g in gpus)
    bw = PCIE_GBS.get(gen, PCIE_GBS[3])
    why = "mixed models cannot share NVLink" if len(keys) > 1 else "no NVLink"
    return Link(bandwidth_gbs=bw, source=f"PCIe {gen}.0 x16 ≈ {bw:g} GB/s effective ({why}; "
                                         "P2P assumed on — without it traffic goes through the CPU)")


@dataclass(frozen=True, kw_only=True)
class CommCost:
    total_s: float           # the whole gradient all-reduce
    overlapped_s: float      # hidden under the last micro-batch's backward
    exposed_s: float         # added to the step

    @staticmethod
    def none() -> CommCost:
        return CommCost(total_s=0.0, overlapped_s=0.0, exposed_s=0.0)


def gradient_sync(n: int, grad_bytes: float, link: Link, *, backward_window_s: float) -> CommCost:
    """All-reduce of the gradients, split into the part DDP overlaps with the last backward and
    the exposed rest (never less than the last bucket, which is ready only when backward ends)."""
    total = allreduce_seconds(n, grad_bytes, link)
    if total == 0.0:
        return CommCost.none()
    last_bucket = allreduce_seconds(n, min(grad_bytes, DDP_BUCKET_BYTES), link)
    exposed = max(last_bucket, total - max(backward_window_s, 0.0))
    exposed = min(exposed, total)
    return CommCost(total_s=total, overlapped_s=total - exposed, exposed_s=exposed)


# -- compute from the catalog -----------------------------------------------------------------
def peak_flops(gpu: GpuSpec, precision: str) -> tuple[float, str]:
    """Dense peak FLOP/s of `gpu` at `precision`, and where the number came from."""
    if precision == "fp32":
        return gpu.fp32_tflops * 1e12, f"{gpu.fp32_tflops:g} TFLOPS fp32"
    tflops = gpu.bf16_tflops if precision == "bf16" else gpu.fp16_tflops
    if tflops <= 0:
        return gpu.fp32_tflops * 1e12, (f"{gpu.fp32_tflops:g} TFLOPS fp32 ({gpu.key} has no {precision} "
                                        "tensor cores; use fp16 on it)")
    return tflops * 1e12, f"{tflops:g} TFLOPS {precision}"


def fixed_bytes(params: int, optimizer: str = "adamw", *, trainable: int | None = None,
                precision: str = "fp32") -> int:
    """Parameters + gradients + optimizer state, unsharded (memory.state_bytes): fp32 for what
    trains (torch autocast keeps fp32 master weights); a frozen part (fine-tuning: `trainable` of
    the `params`) only as weights, at `precision`'s element size (a frozen base loaded in bf16)."""
    return int(state_bytes(params, optimizer=optimizer, trainable=trainable,
                           frozen_param_bytes=ELEMENT_BYTES[precision]).total)


def estimate_profile(model: ModelSpec, gpu: GpuSpec, *, label: str, precision: str = "bf16",
                     efficiency: float = DEFAULT_EFFICIENCY, flops_per_s: float | None = None,
                     flops_reason: str | None = None, memory_bytes: int | None = None,
                     optimizer: str = "adamw") -> DeviceProfile:
    """A profile from datasheet facts: seconds per sample = FLOPs / (peak × efficiency), unless
    `flops_per_s` (effective, efficiency included) is given; optimizer step = reading and writing
    the trainable part's state once at the card's memory bandwidth."""
    if not 0 < efficiency <= 1:
        raise UsageError(f"efficiency {efficiency} is not a fraction", "give --efficiency in (0, 1], e.g. 0.4")
    if flops_per_s is None:
        peak, why = peak_flops(gpu, precision)
        flops_per_s = peak * efficiency
        flops_reason = f"{efficiency:.0%} of {why}"
    state = fixed_bytes(model.params, optimizer, trainable=model.trainable, precision=precision)
    updated = fixed_bytes(model.trainable, optimizer) if model.trainable else 0
    act_scale = ELEMENT_BYTES[precision] / ELEMENT_BYTES[model.activation_precision]
    return DeviceProfile(
        device=label, gpu=gpu.key, precision=precision,
        source=f"catalog estimate: {model.flops_per_sample:.3g} FLOPs/sample at {flops_reason}",
        overhead_s=MICRO_OVERHEAD_S, per_sample_s=model.flops_per_sample / flops_per_s,
        optimizer_s=2 * updated / (gpu.bandwidth_gbs * 1e9),
        fixed_bytes=state,
        # autocast keeps a low-precision copy of the fp32 (trainable) weights while the forward's
        # graph lives; a frozen base already at that precision is used as it is
        activation_fixed_bytes=(2 * model.trainable if precision != "fp32" else 0.0),
        activation_bytes_per_sample=model.activation_bytes_per_sample * act_scale,
        memory_bytes=memory_bytes if memory_bytes is not None else gpu.memory_bytes,
        checkpoint_fraction=model.checkpoint_fraction, blocks=model.blocks,
    )


# -- one step ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Assignment:
    """What one device does in a step: its share, micro-batch cap and checkpointing."""

    profile: DeviceProfile
    share: int
    micro_batch: int
    checkpointing: bool = False
    checkpoint_blocks: int | None = None     # with checkpointing: None every block, k of them

    @property
    def ckpt(self) -> dict:
        """The checkpointing keywords of DeviceProfile's time and memory."""
        return {"checkpointing": self.checkpointing, "blocks": self.checkpoint_blocks}

    @property
    def n_micro(self) -> int:
        return math.ceil(self.share / self.micro_batch)

    @property
    def micro_sizes(self) -> tuple[int, ...]:
        return split_evenly(self.share, self.n_micro)

    @property
    def largest_micro(self) -> int:
        return math.ceil(self.share / self.n_micro)

    @property
    def smallest_micro(self) -> int:
        return self.share // self.n_micro

    def compute_s(self, factor: float = 1.0, *, ddp_cost: float = 1.0) -> float:
        """n·a + b·share (the sizes differ by at most one, so the sum is exact for t = a + b·m),
        plus the last micro-batch's pacing and DDP costs (`last_micro_extra`), times `factor`
        (this device's slowdown from sharing host cores)."""
        p = self.profile
        t = (self.n_micro * p.overhead_s + p.per_sample_s * self.share) * p.recompute(**self.ckpt)
        return (t + self.last_micro_extra(ddp_cost)) * factor

    def last_micro_extra(self, ddp_cost: float = 1.0) -> float:
        """Device seconds the step's last micro-batch costs beyond its profile: (paced_cost ·
        ddp_cost − 1) of it (module docstring; 0 on a GPU)."""
        p = self.profile
        extra = p.paced_cost * ddp_cost - 1
        # the last micro-batch is the smallest (split_evenly: larger first)
        return extra * p.micro_seconds(self.smallest_micro, **self.ckpt) if extra else 0.0

    def memory_bytes(self) -> float:
        return self.profile.memory_needed(self.largest_micro, **self.ckpt)


@dataclass(frozen=True, kw_only=True)
class StepCost:
    step_s: float
    samples_per_s: float
    compute_s: tuple[float, ...]     # per device, contention included
    optimizer_s: float               # the optimizer phase (the slowest device's)
    comm: CommCost
    stretch_by_device: tuple[float, ...]   # compute_s ÷ the device's compute alone (1.0: no contention)
    bottleneck: int                  # index of the device whose compute sets the step
    agree_s: float = 0.0             # hetrain's per-step agreement all-reduce
    straggle_s: float = 0.0          # the step's wait for whichever device is last this time

    @property
    def critical_compute_s(self) -> float:
        return self.compute_s[self.bottleneck]

    @property
    def stretch(self) -> float:
        return max(self.stretch_by_device)


def step_cost(assignments: Sequence[Assignment], *, global_batch: int, grad_bytes: float, link: Link,
              host_cores: float | None = None, host_load: float = 0.0,
              sync_s: float | None = None, agree_s: float = 0.0, straggle: float = 0.0,
              straggle_stretch: float = 1.0, contention: float = 1.0, contention_at: int = 1,
              ddp_cost: float = 1.0, clocked: bool = False) -> StepCost:
    """Predicted step of these assignments (their shares should sum to `global_batch`). Devices
    with a host-CPU share contend for `host_cores` (with `host_load` other runnable processes).
    `sync_s`: the exposed gradient sync as measured (instead of the ring model's); `agree_s`:
    the per-step agreement all-reduce (hetrain's; plain DDP has none); `straggle`, measured at
    contention `straggle_stretch`, `ddp_cost` and `clocked` (emulated devices on the controlled
    clock): see the module docstring."""
    alone = [a.compute_s(ddp_cost=ddp_cost) for a in assignments]
    opt_alone = [a.profile.optimizer_s for a in assignments]
    if host_cores and any(a.profile.cpu_share > 0 for a in assignments):
        shared = dict(cores=host_cores, load=host_load, contention=contention, contention_at=contention_at)
        compute = tuple(shared_cpu_finish([_compute_segments(a, ddp_cost) for a in assignments], **shared))
        opt = max(shared_cpu_finish([_cpu_then_sleep(a.profile, a.profile.optimizer_s) for a in assignments],
                                    **shared))
    else:
        compute, opt = tuple(alone), max(opt_alone)
    factors = tuple(c / t if t > 0 else 1.0 for c, t in zip(compute, alone))
    crit = max(range(len(assignments)), key=lambda i: compute[i])
    last = assignments[crit]
    window = last.profile.micro_seconds(last.smallest_micro, **last.ckpt) \
        * factors[crit] * 2 / 3       # backward ≈ 2/3 of a micro-batch
    if sync_s is not None:
        comm = CommCost(total_s=sync_s, overlapped_s=0.0, exposed_s=sync_s)
    else:
        comm = gradient_sync(len(assignments), grad_bytes, link, backward_window_s=window)
    # the compute whose CPU time shows in the step: on the clock, the last backward's CPU
    jitter = window * last.profile.cpu_share if clocked else compute[crit]
    straggle_s = jitter * straggle_at(straggle, straggle_stretch, max(factors)) if len(compute) > 1 else 0.0
    step = compute[crit] + straggle_s + comm.exposed_s + agree_s + opt
    return StepCost(step_s=step, samples_per_s=global_batch / step, compute_s=compute, optimizer_s=opt,
                    comm=comm, stretch_by_device=factors, bottleneck=crit, agree_s=agree_s,
                    straggle_s=straggle_s)


def straggle_at(straggle: float, measured_stretch: float, stretch: float) -> float:
    """The straggle of a step with contention `stretch`, from one measured at `measured_stretch`
    (as a fraction of the step's compute). Measured without contention: as measured."""
    if measured_stretch <= 1.0:
        return straggle
    return straggle * min(1.0, max(0.0, (stretch - 1.0) / (measured_stretch - 1.0)))


# -- emulated devices sharing the host's cores ------------------------------------------------


def _cpu_then_sleep(p: DeviceProfile, device_s: float) -> list[tuple[bool, float]]:
    """A piece of device time as the emulator runs it: CPU (a share s of it), then the sleep."""
    cpu = device_s * p.cpu_share
    return [(True, cpu), (False, device_s - cpu)]


def _compute_segments(a: Assignment, ddp_cost: float = 1.0) -> list[tuple[bool, float]]:
    """This device's step as the emulator runs it (runtime/devices/emulation.py: one sleep, for the whole
    step's compute, before the last micro-batch's backward): the earlier micro-batches and the last
    forward on the CPU, the sleep, the last backward on the CPU (with the last micro-batch's extra,
    `last_micro_extra`: the throttle books it after that backward, and its sleep is paid in the
    next step's). Segments are (on_cpu, seconds of CPU work or of sleep)."""
    p, extra = a.profile, a.last_micro_extra(ddp_cost)
    dev = sum(p.micro_seconds(m, **a.ckpt) for m in a.micro_sizes) + extra
    last_cpu = p.micro_seconds(a.micro_sizes[-1], **a.ckpt) * p.cpu_share
    cpu = dev * p.cpu_share
    before = cpu - last_cpu * (1 - p.forward_fraction) - extra * p.cpu_share
    return [(True, before), (False, dev - cpu), (True, cpu - before)]


def shared_cpu_finish(jobs: Sequence[Sequence[tuple[bool, float]]], cores: float,
                      load: float = 0.0, *, contention: float = 1.0, contention_at: int = 1) -> list[float]:
    """When each job finishes, all starting at 0, if every job's CPU segments share `cores` with
    `load` other always-runnable processes (processor sharing: each running process gets
    min(1, cores / runnable) of a core) and its sleep segments take their own time. A fluid
    simulation: between events the rates are constant.

    `contention`: how much slower a job computes while `contention_at` jobs compute on separate
    cores (measured); k jobs at once slow each other by 1 + (contention − 1)·(k − 1)/(contention_at − 1),
    nothing when one computes alone (core_sharing.cpu_rate, which pipelines use too)."""
    queue = [[(cpu, d) for cpu, d in job if d > 1e-12] for job in jobs]
    pos = [0] * len(queue)
    left = [q[0][1] if q else 0.0 for q in queue]
    finish = [0.0 if not q else math.nan for q in queue]
    t = 0.0
    while True:
        live = [j for j, q in enumerate(queue) if pos[j] < len(q)]
        if not live:
            return finish
        running = [j for j in live if queue[j][pos[j]][0]]
        rate = cpu_rate(len(running), cores=cores, load=load, contention=contention, contention_at=contention_at)
        dt = min(left[j] / (rate if queue[j][pos[j]][0] else 1.0) for j in live)
        t += dt
        for j in live:
            left[j] -= dt * (rate if queue[j][pos[j]][0] else 1.0)
            if left[j] <= 1e-12:
                pos[j] += 1
                if pos[j] < len(queue[j]):
                    left[j] = queue[j][pos[j]][1]
                else:
                    finish[j] = t


def standalone(profile: DeviceProfile, *, global_batch: int, margin: float, checkpointing: bool = False,
               micro_cap: int | None = None, blocks: int | None = None) -> float:
    """Samples/s of this device training alone on the whole global batch (0 if it cannot fit one)."""
    cap = profile.max_micro_batch(margin=margin, checkpointing=checkpointing, blocks=blocks)
    if cap == 0:
        return 0.0
    micro = global_batch if cap is None else min(cap, global_batch)
    if micro_cap is not None:
        micro = min(micro, micro_cap)
    a = Assignment(profile=profile, share=global_batch, micro_batch=micro, checkpointing=checkpointing,
                   checkpoint_blocks=blocks)
    return global_batch / (a.compute_s() + profile.optimizer_s)
