"""The cost model: how long a step takes and how much memory it needs, for a given split. Pure.

Step time of data parallelism with per-device shares (one optimizer step over the global batch):

    step = max_r compute_r  +  exposed gradient sync  +  max_r optimizer_r
    compute_r = n_r·a_r + b_r·share_r        (n_r micro-batches; t(m) = a + b·m per micro-batch)

Gradient sync is a ring all-reduce of the gradients, S bytes over n devices, limited by the slowest
link B: 2(n−1)/n · S/B + 2(n−1)·latency. DDP all-reduces bucket by bucket while the last
micro-batch's backward still runs on the slowest device, so that part of the sync is hidden
(overlapped); what is left after the backward ends — at least the last bucket — is exposed.

Compute without a profile comes from the model's FLOPs per sample and the catalog's peak at the
precision, times a stated efficiency (model FLOPs utilisation, default 40%).

Memory: parameters, gradients and optimizer state (fixed), plus one micro-batch's activations;
activation checkpointing keeps a fraction of them and recomputes one forward (×4/3 compute).

Emulated devices share the host's CPU cores: a device of speed s computes for a fraction s of its
busy time, so when the devices together (with whatever else the host runs) want more than the
host's cores, every compute piece stretches. `cpu_stretch` finds that factor (processor sharing),
and the planner plans with the stretched times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.catalog import GpuSpec
from .plan import split_evenly
from .profile import DeviceProfile, ModelSpec

DEFAULT_EFFICIENCY = 0.40            # model FLOPs utilisation assumed for catalog estimates
DDP_BUCKET_BYTES = 25 * 1024**2      # torch DDP's default bucket_cap_mb
RING_HOP_LATENCY_S = 10e-6           # per ring step on NVLink/PCIe (NCCL, order of magnitude)
MICRO_OVERHEAD_S = 2e-3              # per micro-batch launch/Python cost assumed without a profile
# Effective all-reduce bus bandwidth of a PCIe x16 slot, GB/s (~75% of the 16/32/64 GB/s link).
PCIE_GBS = {3: 12.0, 4: 24.0, 5: 48.0}
NVLINK_EFFICIENCY = 0.4              # NCCL bus bandwidth / catalog NVLink figure (A100: ~240 of 600)
BYTES_PER_PARAM = {                  # fp32 weights + fp32 gradients + optimizer state, per parameter
    "adamw": 16, "adam": 16, "sgd-momentum": 12, "sgd": 8,
}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_ELEMENT_BYTES = 4               # DDP all-reduces fp32 gradients (autocast keeps fp32 weights)


# -- links and communication ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Link:
    """The slowest link of the ring: effective bus bandwidth and per-hop latency."""

    bandwidth_gbs: float
    latency_s: float = RING_HOP_LATENCY_S
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_gbs > 0 or not self.latency_s >= 0:
            raise UsageError(f"link bandwidth {self.bandwidth_gbs} GB/s, latency {self.latency_s} s",
                             "give a positive bandwidth, e.g. --link-gbs 24")


FREE_LINK = Link(bandwidth_gbs=math.inf, latency_s=0.0, source="communication not modelled")


def allreduce_seconds(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce: 2(n−1)/n · S/B + 2(n−1) hops of latency; 0 for one device."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bandwidth_gbs * 1e9) + 2 * (n - 1) * link.latency_s


def link_from_measurement(n: int, nbytes: float, seconds: float, source: str) -> Link:
    """The bus bandwidth that explains one measured all-reduce of `nbytes` over n devices."""
    seconds = max(seconds, 1e-9)
    return Link(bandwidth_gbs=2 * (n - 1) / n * nbytes / seconds / 1e9 if n > 1 else math.inf,
                latency_s=0.0, source=source)


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


def fixed_bytes(params: int, optimizer: str = "adamw") -> int:
    """Parameters + gradients + optimizer state (fp32 master weights, as torch autocast keeps them)."""
    try:
        return params * BYTES_PER_PARAM[optimizer]
    except KeyError:
        raise UsageError(f"unknown optimizer {optimizer!r}", f"use one of {tuple(BYTES_PER_PARAM)}") from None


def estimate_profile(model: ModelSpec, gpu: GpuSpec, *, label: str, precision: str = "bf16",
                     efficiency: float = DEFAULT_EFFICIENCY, flops_per_s: float | None = None,
                     flops_reason: str | None = None, memory_bytes: int | None = None,
                     optimizer: str = "adamw") -> DeviceProfile:
    """A profile from datasheet facts: seconds per sample = FLOPs / (peak × efficiency), unless
    `flops_per_s` (effective, efficiency included) is given; optimizer step = reading and writing
    the fixed state once at the card's memory bandwidth."""
    if not 0 < efficiency <= 1:
        raise UsageError(f"efficiency {efficiency} is not a fraction", "give --efficiency in (0, 1], e.g. 0.4")
    if flops_per_s is None:
        peak, why = peak_flops(gpu, precision)
        flops_per_s = peak * efficiency
        flops_reason = f"{efficiency:.0%} of {why}"
    state = fixed_bytes(model.params, optimizer)
    act_scale = ELEMENT_BYTES[precision] / ELEMENT_BYTES[model.activation_precision]
    return DeviceProfile(
        device=label, gpu=gpu.key, precision=precision,
        source=f"catalog estimate: {model.flops_per_sample:.3g} FLOPs/sample at {flops_reason}",
        overhead_s=MICRO_OVERHEAD_S, per_sample_s=model.flops_per_sample / flops_per_s,
        optimizer_s=2 * state / (gpu.bandwidth_gbs * 1e9),
        fixed_bytes=state,
        # autocast keeps a low-precision copy of the weights while the forward's graph lives
        activation_fixed_bytes=(2 * model.params if precision != "fp32" else 0.0),
        activation_bytes_per_sample=model.activation_bytes_per_sample * act_scale,
        memory_bytes=memory_bytes if memory_bytes is not None else gpu.memory_bytes,
        checkpoint_fraction=model.checkpoint_fraction,
    )


# -- one step ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Assignment:
    """What one device does in a step: its share, micro-batch cap and checkpointing."""

    profile: DeviceProfile
    share: int
    micro_batch: int
    checkpointing: bool = False

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

    def compute_s(self, stretch: float = 1.0) -> float:
        """n·a + b·share (the sizes differ by at most one, so the sum is exact for t = a + b·m)."""
        p = self.profile
        t = self.n_micro * p.overhead_s + p.per_sample_s * self.share
        if self.checkpointing:
            t *= p.recompute_factor
        return t * contention(p, stretch)

    def memory_bytes(self) -> float:
        return self.profile.memory_needed(self.largest_micro, checkpointing=self.checkpointing)


def contention(profile: DeviceProfile, stretch: float) -> float:
    """How much longer this device's compute takes when host CPU pieces stretch by `stretch`."""
    return 1.0 + profile.cpu_share * (stretch - 1.0)


@dataclass(frozen=True, kw_only=True)
class StepCost:
    step_s: float
    samples_per_s: float
    compute_s: tuple[float, ...]     # per device, stretched
    optimizer_s: float               # the slowest device's optimizer step
    comm: CommCost
    stretch: float                   # CPU contention factor (1.0: none)
    bottleneck: int                  # index of the device whose compute sets the step

    @property
    def critical_compute_s(self) -> float:
        return self.compute_s[self.bottleneck]


def step_cost(assignments: Sequence[Assignment], *, global_batch: int, grad_bytes: float, link: Link,
              host_cores: float | None = None, host_load: float = 0.0,
              stretch: float | None = None) -> StepCost:
    """Predicted step of these assignments (their shares should sum to `global_batch`)."""
    def at(f: float) -> StepCost:
        compute = tuple(a.compute_s(f) for a in assignments)
        crit = max(range(len(assignments)), key=lambda i: compute[i])
        last = assignments[crit]
        window = last.profile.micro_seconds(last.smallest_micro, checkpointing=last.checkpointing) \
            * contention(last.profile, f) * 2 / 3       # backward ≈ 2/3 of a micro-batch
        comm = gradient_sync(len(assignments), grad_bytes, link, backward_window_s=window)
        opt = max(a.profile.optimizer_s * contention(a.profile, f) for a in assignments)
        step = compute[crit] + comm.exposed_s + opt
        return StepCost(step_s=step, samples_per_s=global_batch / step, compute_s=compute,
                        optimizer_s=opt, comm=comm, stretch=f, bottleneck=crit)

    if stretch is not None:
        return at(stretch)
    if not host_cores:
        return at(1.0)
    cpu = [a.profile.cpu_share * (a.compute_s() + a.profile.optimizer_s) for a in assignments]
    return at(cpu_stretch(lambda f: at(f).step_s, cpu, host_cores, host_load))


def cpu_stretch(step_at: Callable[[float], float], cpu_seconds: Sequence[float], cores: float,
                load: float = 0.0) -> float:
    """The factor f >= 1 by which host-CPU compute stretches (processor sharing): a running process
    gets cores / (runnable processes) of a core, so f = (load + K) / cores when that exceeds 1, with
    K = Σ_r min(1, cpu_r·f / step) the devices computing at a time on average and `load` other
    runnable processes on the host. With no load this says the step's CPU work must fit in
    cores × step."""
    def excess(f: float) -> float:
        step = step_at(f)
        busy = sum(min(1.0, c * f / step) for c in cpu_seconds) if step > 0 else 0.0
        return (load + busy) / cores - f

    if excess(1.0) <= 0:
        return 1.0
    lo, hi = 1.0, 2.0
    while excess(hi) > 0:
        hi *= 2
        if hi > 1e6:
            return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def standalone(profile: DeviceProfile, *, global_batch: int, margin: float, checkpointing: bool = False,
               micro_cap: int | None = None) -> float:
    """Samples/s of this device training alone on the whole global batch (0 if it cannot fit one)."""
    cap = profile.max_micro_batch(margin=margin, checkpointing=checkpointing)
    if cap == 0:
        return 0.0
    micro = global_batch if cap is None else min(cap, global_batch)
    if micro_cap is not None:
        micro = min(micro, micro_cap)
    a = Assignment(profile=profile, share=global_batch, micro_batch=micro, checkpointing=checkpointing)
    return global_batch / (a.compute_s() + profile.optimizer_s)
