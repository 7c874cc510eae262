"""How an emulated device is measured: what it answers the profiler and the probes
(runtime/devices/measuring.py), made by its hooks (EmulatedHooks.measuring).

The profile. Each emulated device is a single CPU thread, so what the profiler measures is this
thread's CPU time (as the throttle does), and the profile is converted by the emulated speed s:
the throttle sleeps c·(1/s − 1) after each compute piece of c CPU-seconds, so the device's seconds
are c/s, of which a fraction s occupies a host core (`cpu_share`, which the cost model uses to
account for devices contending for the host's cores): `emulated`.

On the controlled clock (Emulation.sample_s) a device's compute lasts what its clock says, not
c/s, and the profiler is not told the clock: it times the device as training runs it, each
forward and backward through a fresh throttle of the device's own (device.Throttle: the sleep
before the backward, the guess of the backward settled after it; `EmulatedPace`), the time being
the thread's CPU time plus the sleeps (the device's busy time, as its hooks count it), and fits
a + b·m to that as to any device's times. `cpu_share` is then measured too: the CPU seconds over
the device's seconds, over all the sizes timed. Such a profile is cached per clock and speed, and
only renamed for the device (`clocked`).

On the CPU's own clock the sizes are timed flat out, one pass after another, but training paces a
pass: the throttle sleeps before the backward of a step's last micro-batch. A backward after that
sleep costs more CPU than a hot one (caches and the core went to other work: 1.4-4% more on a
2-core EPYC, measured inside training runs), and the throttle charges that CPU as the device's
compute. So the profiler also times a few passes paced as training paces them (through a fresh
throttle of the device's own: the sleep before the backward), each beside a flat-out pass, and
keeps the median ratio as `paced_cost` (pacing.py; planning/cost.py charges it on a step's last
micro-batch). Such a profile is cached per speed; a device at speed 1, which never sleeps, is not
paced.

The probes (FSDP2's, tensor parallelism's) run each rank's compute throttled as in training, each
through a fresh throttle (its own books: the device's keep the training's), and their collectives
through the emulated inter-node link (link.py). MFU's peak is this host's measured one-thread
matmul FLOP/s in the precision the device computes in (hardware/host.py) × the emulated speed:
the most its throttle lets it reach.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from ..hardware.cluster import ClusterDevice
from ..planning.profile import DeviceProfile, fit_linear
from ..runtime.devices.measuring import DeviceMeasuring, Pace
from .pacing import PACED_PASS_S, paced_cost

MEANING_EMULATED = ("emulated: each CPU process against this CPU thread's measured matmul FLOP/s x the "
                    "device's emulated speed (not a GPU figure)")


class EmulatedPace(Pace):
    """A probe's run of work through a throttle of the device's own (a fresh one: device.Throttle),
    as devices/hooks.py and EmulatedHooks place it: the sleep before the backward (on the controlled
    clock the pair lasting its clocked length for the samples; else the forward's CPU and the
    predicted backward's stretched), the backward's error owed to the next settle, the optimizer
    under `compute()`."""

    timing = "busy time on its controlled clock (CPU + sleeps)"

    def __init__(self, throttle):
        self.throttle = throttle

    def busy(self) -> float:
        return self.throttle.busy()

    def before_backward(self, forward_cpu: float, *, samples: int = 1) -> float:
        return self.throttle.before_backward(forward_cpu, samples=samples)

    def after_backward(self, forward_cpu: float, guess: float, backward_cpu: float) -> None:
        self.throttle.after_backward(forward_cpu, guess, backward_cpu)

    def settle(self) -> None:
        self.throttle.settle()

    def compute(self):
        return self.throttle.compute()

    def sharded(self, share: float) -> None:
        """On the controlled clock a TP rank's micro-batch lasts its share of the model's clock
        (as EmulatedHooks.model_sharded sets it in training)."""
        if self.throttle.sample_s is not None:
            self.throttle.sample_s = self.throttle.sample_s * share


class EmulatedMeasuring(DeviceMeasuring):
    """An emulated device `spec` (this rank's ClusterDevice) and its throttle (None: measured as
    on the CPU's own clock and never paced)."""

    label_note = "emulated "
    cpu_clock = True
    mfu_meaning = MEANING_EMULATED

    def __init__(self, spec: ClusterDevice, throttle, device):
        super().__init__(device)
        self.spec = spec
        self.throttle = throttle
        self.on_clock = throttle is not None and throttle.clocked and device.type != "cuda"
        # a device at speed 1 never sleeps: nothing to pace (its ratio would be noise clamped upward)
        self.paced = throttle is not None and not self.on_clock and device.type != "cuda" and throttle.speed < 1

    def memory_bytes(self, found: int | None) -> int | None:
        return self.spec.memory_bytes

    def profile_key(self, key: str) -> str:
        t = self.throttle
        if self.on_clock:      # its times are this clock's at this speed: kept apart from any other's
            clock = hashlib.sha256(repr((t.sample_s, t.micro_s, t.speed)).encode()).hexdigest()[:10]
            return f"{key} clock {clock}"
        if self.paced:         # its paced_cost is this speed's (the sleep's length)
            return f"{key} speed {t.speed:g}"
        return key

    def timed_by(self) -> Pace | None:
        return EmulatedPace(self.throttle.fresh()) if self.on_clock else None

    def extra_measures(self, model, batch_of, fwd, *, sizes, cpu_seconds) -> dict:
        if not self.paced:
            return {}
        quick = [m for m, t in zip(sizes, cpu_seconds) if t <= PACED_PASS_S] or sizes[:1]
        return {"paced_cost": paced_cost(model, batch_of(quick[-1]), fwd, self.throttle.fresh())}

    def as_profile(self, raw: DeviceProfile, *, label: str, key: str, memory_bytes: int | None) -> DeviceProfile:
        return clocked(raw, self.spec) if self.on_clock else emulated(raw, self.spec)

    def pace(self) -> Pace:
        return EmulatedPace(self.throttle.fresh()) if self.throttle is not None else Pace()

    def link(self, job, *, ring: int | None = None):
        from .link import throttle_for

        return throttle_for(job, ring=ring)

    def peak_flops(self, compute: str, host) -> float | None:
        cpu = host.matmul_flops(compute) if host is not None else None
        return cpu * self.spec.speed if cpu else None


def emulated(raw: DeviceProfile, spec: ClusterDevice) -> DeviceProfile:
    """A CPU measurement as the emulated device `spec` runs it: c/s seconds, a fraction s on a core."""
    s = spec.speed
    return raw.scaled(1.0 / s, device=f"{spec.label} (emulated)", cpu_share=s, gpu=spec.gpu.key,
                      memory_bytes=spec.memory_bytes,
                      source=f"measured on this CPU, ×1/{s:.3g} for the emulated speed ({spec.speed_source})")


def clocked(raw: DeviceProfile, spec: ClusterDevice) -> DeviceProfile:
    """A measurement on the emulated device `spec`'s controlled clock: its times are the device's
    already (measured through its throttle), so only what it is called changes."""
    return replace(raw, device=f"{spec.label} (emulated)", gpu=spec.gpu.key, memory_bytes=spec.memory_bytes,
                   source=raw.source.replace(f"measured on {raw.device}", f"measured on {spec.label} (emulated)"))


def pool_emulated(profiles: list[DeviceProfile], specs: list[ClusterDevice]) -> list[DeviceProfile]:
    """Emulated devices are all this host's CPU, measured once per rank: pool the measurements
    (less noise than any one rank's) and convert back to each device's speed. Only ranks of the
    same precision pool (fp16 on a CPU is many times slower than bf16), and each device refits
    t(m) = a + b·m on the pooled points within its own measured sizes: a memory-capped device
    measured 1…4 samples, and a line through 1…64 would misstate its small micro-batches (and
    its few points would bend the large device's line)."""
    raw = [p.scaled(spec.speed) for p, spec in zip(profiles, specs)]
    out = []
    for p, spec in zip(profiles, specs):
        alike = [r for r in raw if r.precision == p.precision]
        if len(alike) < 2:
            out.append(p)
            continue
        mean = {f: sum(getattr(r, f) for r in alike) / len(alike) for f in ("optimizer_s", "forward_fraction")}
        top = max(p.sizes, default=0)
        points = [(m, t) for r in alike for m, t in zip(r.sizes, r.seconds) if m <= top]
        if len({m for m, _ in points}) >= 2:
            a, b = fit_linear([m for m, _ in points], [t for _, t in points])
        else:       # no points recorded (an older cached profile): average the fitted lines
            a = sum(r.overhead_s for r in alike) / len(alike)
            b = sum(r.per_sample_s for r in alike) / len(alike)
        out.append(replace(p, overhead_s=a / spec.speed, per_sample_s=b / spec.speed,
                           optimizer_s=mean["optimizer_s"] / spec.speed, forward_fraction=mean["forward_fraction"],
                           source=p.source + f", pooled with the {len(alike)} {p.precision} ranks' "
                                             f"measurements of this CPU up to {top} samples"))
    return out
