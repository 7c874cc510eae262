"""Short measurements of the user's model on this rank's device, before training starts.

One forward+backward on a few real samples gives the activation bytes per sample (which caps the
micro-batch under a memory limit); a few more at two micro-batch sizes give the time as
fixed + per-sample (which sets the shares: a step that is half fixed overhead should not be split
in proportion to speed alone). RNG state is restored afterwards so a probed run draws the same
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
          device: torch.device) -> ProbeResult:
    """Activation bytes per sample, from one forward on `samples` samples."""
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
        model.zero_grad(set_to_none=True)
    return ProbeResult(samples=samples, activation_bytes_per_sample=act / samples)


@dataclass(frozen=True)
class Timing:
    """Forward+backward time of one micro-batch of m samples: fixed_s + m · per_sample_s."""

    fixed_s: float
    per_sample_s: float
    sizes: tuple[int, ...]

    def __call__(self, m: int) -> float:
        return self.fixed_s + m * self.per_sample_s


def time_sizes(model: torch.nn.Module, batches: dict[int, object], *, forward=default_forward,
               device: torch.device, runs: int = 3) -> Timing:
    """Fit fixed + per-sample time from forward+backward passes at two or more micro-batch sizes
    (after one warm-up pass each; median of `runs`). CPU: this thread's CPU time, so a throttled
    (emulated) device measures the CPU's own speed; CUDA: synchronised wall time."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    medians = {}
    with torch.random.fork_rng(devices=[device] if cuda else []):
        for m, batch in sorted(batches.items()):
            times = []
            for i in range(runs + 1):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = clock()
                _as_scalar(forward(model, batch)).backward()
                if cuda:
                    torch.cuda.synchronize(device)
                if i:
                    times.append(clock() - t0)
            medians[m] = sorted(times)[len(times) // 2]
        model.zero_grad(set_to_none=True)
    sizes = sorted(medians)
    lo, hi = sizes[0], sizes[-1]
    per_sample = (medians[hi] - medians[lo]) / (hi - lo) if hi > lo else 0.0
    if per_sample <= 0:   # noise swamped the difference: call it all per-sample
        return Timing(fixed_s=0.0, per_sample_s=medians[hi] / hi, sizes=tuple(sizes))
    return Timing(fixed_s=max(0.0, medians[lo] - lo * per_sample), per_sample_s=per_sample, sizes=tuple(sizes))
