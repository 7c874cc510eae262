"""What MFU is made of: the model's training FLOPs per sample, and every device's peak FLOP/s.

MFU (model FLOPs utilisation) of a device in a step is the FLOP/s it achieved on the model,
its samples × the training FLOPs per sample ÷ its compute seconds (forward + backward, as the
device experiences them), over its peak FLOP/s:

  FLOPs per sample  measured once, on rank 0 before training: torch's FlopCounterMode over one
                    forward + backward of a micro-batch of (at most) 2 samples, divided by its size
                    (matmuls, convolutions and attention: what MFU counts). Data parallel only: under
                    pipelines and tensor parallelism a device computes part of the model (no MFU).
  peak              what the device states (its hooks' measuring: DeviceMeasuring.peak_flops) in
                    the precision it computes in: a GPU's catalog dense peak (planning/cost.py:
                    peak_flops; a GPU not in the catalog has none), none on a plain CPU (no MFU).
                    A device may state another (measured from this host's facts): its MFU is
                    then against that peak, as a GPU's is against its own, with what that means
                    said in the facts (`meaning`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..user_objects import as_scalar
from ..ranks import agree


@dataclass(frozen=True, kw_only=True)
class FlopFacts:
    """The same on every rank (agreed at the end of prepare())."""

    flops_per_sample: float | None          # training FLOPs (forward + backward) of one sample
    how: str                                # how rank 0 found it, for people (rank 0's record)
    peaks: tuple[float | None, ...]         # every rank's peak FLOP/s (None: unknown)
    meaning: str                            # what the MFU figure means here

    def mfu(self, rank: int, *, samples: float, compute_s: float) -> float | None:
        return mfu(samples=samples, flops_per_sample=self.flops_per_sample, compute_s=compute_s,
                   peak_flops=self.peaks[rank] if rank < len(self.peaks) else None)


def mfu(*, samples: float, flops_per_sample: float | None, compute_s: float, peak_flops: float | None) -> float | None:
    """samples × FLOPs per sample / compute seconds / peak FLOP/s; None when a part is unknown."""
    if not flops_per_sample or not peak_flops or not compute_s > 0:
        return None
    return samples * flops_per_sample / compute_s / peak_flops


def format_mfu(x: float | None) -> str:
    """MFU as people read it: 31%, 0.42% (a device far from its peak is often below 1%)."""
    if x is None:
        return "-"
    return f"{x:.0%}" if x >= 0.095 else f"{x:.2%}"


def count_flops_per_sample(model: torch.nn.Module, batch, size: int, forward) -> tuple[float | None, str]:
    """Training FLOPs per sample of `model` on `batch` (`size` samples), measured. Nothing of the
    model changes: eval mode for the count (batch norm's running statistics stay), its gradients
    and the RNG put back after."""
    from torch.utils.flop_counter import FlopCounterMode

    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = [p.device for p, _ in grads[:1] if p.device.type == "cuda"]
    model.eval()
    try:
        with torch.random.fork_rng(devices=cuda), FlopCounterMode(display=False) as counter:
            loss = as_scalar(forward(model, batch))
            backward = loss.requires_grad
            if backward:
                loss.backward()
        total = counter.get_total_flops()
    except Exception as e:  # noqa: BLE001 — any model the count cannot run: no MFU, training goes on
        return None, f"not measured ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    finally:
        for m, training in modes:
            m.training = training
        for p, g in grads:
            p.grad = g
    if not total:
        return None, "not measured (FlopCounterMode counted no FLOPs: no matmul, convolution or attention)"
    if not backward:      # nothing to backpropagate: the usual rule, backward = 2 × forward
        return 3 * total / size, f"measured forward ({size} samples, FlopCounterMode) x 3"
    return total / size, f"measured forward+backward of {size} samples (FlopCounterMode)"


def local_peak(job) -> float | None:
    """This rank's peak FLOP/s in the precision it computes in, as its device states it."""
    return job.hooks.measuring().peak_flops(job.precision.compute, job.host)


def agree_flop_facts(job, counted: tuple[float | None, str] | None) -> FlopFacts:
    """Every rank's peak and rank 0's count, the same on every rank (collective: one exchange)."""
    flops, how = counted if counted is not None else (None, "not measured: MFU is for data parallelism")
    peak = local_peak(job)
    table = agree.exchange({"peak": peak or -1.0, "flops": flops if job.rank == 0 and flops else -1.0},
                           rank=job.rank, world_size=job.world_size, device=job.device)
    flops = table.column("flops")[0]
    return FlopFacts(flops_per_sample=flops if flops > 0 else None, how=how if job.rank == 0 else "",
                     peaks=tuple(p if p > 0 else None for p in table.column("peak")),
                     meaning=job.hooks.measuring().mfu_meaning)


def count_for(job, model, forward) -> tuple[float | None, str] | None:
    """Rank 0's count before the model is wrapped (no collective can run in its forward)."""
    if job.rank != 0:
        return None
    size = max(1, min(2, len(job.dataset), *(d.micro_batch for d in job.plan.devices)))
    return count_flops_per_sample(model, job.load(range(size)), size, forward)
