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

Devices that share something the cost model cannot see apart (the processes of one host, CPU
threads playing GPUs) carry it in their profiles (DeviceProfile.host): the step is then played out
on it, it adds its stragglers (every step waits for its last device, and which one is last
changes from step to step) and the CPU a synced micro-batch costs there. Devices with no host
compute independently, as GPUs do, and only the last micro-batch's measured `paced_cost` is added.

Compute without a profile comes from the model's FLOPs per sample and the catalog's peak at the
precision, times a stated efficiency (model FLOPs utilisation, default 40%).

Memory: parameters, gradients and optimizer state (fixed; memory.state_bytes), plus one
micro-batch's activations; activation checkpointing keeps a fraction of them and recomputes one
forward (×4/3 compute).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hardware.catalog import GpuSpec
from ..hardware.links import NVLINK_EFFICIENCY, PCIE_GBS  # noqa: F401 — PCIE_GBS: simulate imports it from here
from .collectives import Link, allreduce_seconds
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
    compute_s: tuple[float, ...]     # per device, what they share included
    optimizer_s: float               # the optimizer phase (the slowest device's)
    comm: CommCost
    stretch_by_device: tuple[float, ...]   # compute_s ÷ the device's compute alone (1.0: nothing shared)
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
              sync_s: float | None = None, agree_s: float = 0.0, host=None, synced: bool = True) -> StepCost:
    """Predicted step of these assignments (their shares should sum to `global_batch`). `sync_s`:
    the exposed gradient sync as measured (instead of the ring model's); `agree_s`: the per-step
    agreement all-reduce (hetrain's; plain DDP has none). `host`: what the devices' processes
    share (DeviceProfile.host; default the first assignment's): the step played out on it, its
    stragglers and the CPU a synced micro-batch adds (`synced`: DDP syncs the gradients); None:
    devices that compute independently, as GPUs do."""
    if host is None and assignments:
        host = assignments[0].profile.host
    ddp_cost = host.ddp_cost if host is not None and synced else 1.0
    alone = [a.compute_s(ddp_cost=ddp_cost) for a in assignments]
    played = host.play(assignments, ddp_cost) if host is not None else None
    compute, opt = played if played is not None else (tuple(alone), max(a.profile.optimizer_s for a in assignments))
    factors = tuple(c / t if t > 0 else 1.0 for c, t in zip(compute, alone))
    crit = max(range(len(assignments)), key=lambda i: compute[i])
    last = assignments[crit]
    window = last.profile.micro_seconds(last.smallest_micro, **last.ckpt) \
        * factors[crit] * 2 / 3       # backward ≈ 2/3 of a micro-batch
    if sync_s is not None:
        comm = CommCost(total_s=sync_s, overlapped_s=0.0, exposed_s=sync_s)
    else:
        comm = gradient_sync(len(assignments), grad_bytes, link, backward_window_s=window)
    straggle_s = (host.straggle_s(window=window, cpu_share=last.profile.cpu_share, compute_s=compute[crit],
                                  stretch=max(factors)) if host is not None and len(compute) > 1 else 0.0)
    step = compute[crit] + straggle_s + comm.exposed_s + agree_s + opt
    return StepCost(step_s=step, samples_per_s=global_batch / step, compute_s=compute, optimizer_s=opt,
                    comm=comm, stretch_by_device=factors, bottleneck=crit, agree_s=agree_s,
                    straggle_s=straggle_s)


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
