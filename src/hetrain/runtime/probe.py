"""Short measurements of the user's model on this rank's device, before training starts.

One or two forward+backward passes on a few real samples give the activation bytes per sample
(which caps the micro-batch under a memory limit) and, off emulation, the seconds per sample
(which sets the device's share). RNG state is restored afterwards so a probed run draws the same
random numbers as an unprobed one, and gradients are cleared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .emulate import MemoryMeter


@dataclass(frozen=True)
class ProbeResult:
    samples: int
    activation_bytes_per_sample: float
    seconds_per_sample: float | None   # None when timing was not asked for


def default_forward(model, batch):
    """How hetrain calls a model on a batch it knows nothing about: model(x) for (x, y) batches,
    model(**batch) for dicts, model(batch) otherwise. Pass prepare(forward=...) to change it."""
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def _as_scalar(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return sum(_as_scalar(o) for o in out if isinstance(o, (torch.Tensor, tuple, list, dict)))
    raise TypeError(f"cannot reduce a model output of type {type(out).__name__} to a scalar; "
                    "pass prepare(forward=...) that returns a tensor")


def probe(model: torch.nn.Module, batch, *, samples: int, forward=default_forward,
          timed_runs: int = 0, device: torch.device) -> ProbeResult:
    """Activation bytes/sample from one forward; seconds/sample from `timed_runs` more passes."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        meter = MemoryMeter(label="probe", cap=None)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with meter.forward():
            loss = _as_scalar(forward(model, batch))
        act = meter.activations
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
            act = max(act, torch.cuda.max_memory_allocated(device) - base)
        seconds = None
        if timed_runs > 0:
            t0 = time.perf_counter()
            for _ in range(timed_runs):
                _as_scalar(forward(model, batch)).backward()
            if cuda:
                torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - t0) / (timed_runs * samples)
        model.zero_grad(set_to_none=True)
    return ProbeResult(samples=samples, activation_bytes_per_sample=act / samples,
                       seconds_per_sample=seconds)
