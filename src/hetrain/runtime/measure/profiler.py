"""The profiler: measures the user's model on this rank's device, before training, in bounded time.

For a few micro-batch sizes (1, 2, 4, … up to the largest that memory and the global batch allow)
it times forward + backward and fits t(m) = a + b·m; it counts the activation bytes at two sizes
(saved-tensor bytes on CPU and emulated devices, `max_memory_allocated` over the forward on CUDA) and
fits c + d·m; it times one optimizer step on a copy of the optimizer (the model is never stepped)
and reads the fixed memory — parameters, gradients, optimizer state — off that copy. No
torch.distributed here: every rank measures its own device alone (the collective probes that
follow are sync_probes.py's).

Results are cached by model signature (architecture, parameter and batch shapes, optimizer type,
precision, torch version) and device (CUDA name, or CPU model and thread count) under
$HETRAIN_CACHE/profiles (default ~/.cache/hetrain/profiles; HETRAIN_CACHE=off disables it), so a
restart does not measure again.

Emulated devices. Each one is a single CPU thread, so what is measured is this thread's CPU time
(as the emulator's throttle does), and the profile is converted by the emulated speed s: the
emulator sleeps c·(1/s − 1) after each compute piece of c CPU-seconds, so the device's seconds are
c/s, of which a fraction s occupies a host core (`cpu_share`, which the cost model uses to account
for devices contending for the host's cores).

On the controlled clock (Emulation.sample_s) a device's compute lasts what its clock says,
not c/s, and the profiler is not told the clock: it times the device as training runs it, each
forward and backward through a fresh throttle of the device's own (emulation/device.Throttle:
the sleep before the backward, the guess of the backward settled after it), the time being the
thread's CPU time plus the sleeps (the device's busy time, as its hooks count it), and fits
a + b·m to that as to any device's times. `cpu_share` is then measured too: the CPU seconds over
the device's seconds, over all the sizes timed. Such a profile is cached per clock and speed.

On the CPU's own clock the sizes are timed flat out, one pass after another, but training paces a
pass: the throttle sleeps before the backward of a step's last micro-batch. A backward after that
sleep costs more CPU than a hot one (caches and the core went to other work: 1.4-4% more on a
2-core EPYC, measured inside training runs), and the throttle charges that CPU as the device's
compute. So the profiler also times a few passes paced as training paces them (through a
fresh throttle of the device's own: the sleep before the backward), each beside a flat-out pass,
and keeps the median ratio as `paced_cost` (emulation/pacing.py; cost.py charges it on a step's last
micro-batch). Such a profile is cached per speed; a device at speed 1, which never sleeps, is
not paced.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import statistics
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from ..devices import clock as clocks
from ...files import cache_dir as _files_cache_dir, write_text_atomic
from ...hardware.cluster import ClusterDevice
from ...hardware.host import cpu_identity
from ...planning.profile import DeviceProfile, fit_linear
from ...emulation.device import MemoryMeter, model_state_bytes
from ..devices.precision_policy import DTYPES
from ..user_objects import as_scalar, default_forward
from ...emulation.pacing import PACED_PASS_S, paced_cost

PROFILER_VERSION = 4             # 2: times forwards without the emulated meter's hooks (training looks them up);
                                # 3: frozen parameters in the optimizer get no state; 4: devices on the
                                # controlled clock timed through their throttle (paced profiles: their own key)
MAX_SIZE = 64                  # largest micro-batch timed; beyond it the fit extrapolates
MIN_TIMED_S = 0.1              # time each size for at least this long…
MAX_RUNS = 5                   # …in at most this many runs (the median is kept)


# -- cache ------------------------------------------------------------------------------------
def cache_dir() -> Path | None:
    """Where profiles are kept, or None when caching is off."""
    return _files_cache_dir("profiles")


def model_signature(model: torch.nn.Module, optimizer, sample, *, precision: str, max_size: int) -> str:
    """Changes when anything that changes the measurement changes."""
    h = hashlib.sha256()
    cls = type(model)
    parts = [f"v{PROFILER_VERSION}", torch.__version__, f"{cls.__module__}.{cls.__qualname__}", precision,
             str(max_size), type(optimizer).__name__ if optimizer is not None else "none"]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in model.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in model.named_buffers()]
    parts += [str(type(m).__name__) for m in model.modules()]

    def shapes(obj):
        if isinstance(obj, torch.Tensor):
            return f"T{tuple(obj.shape[1:])}{obj.dtype}"
        if isinstance(obj, (tuple, list)):
            return "(" + ",".join(shapes(o) for o in obj) + ")"
        if isinstance(obj, Mapping):         # a BatchEncoding too: its shapes, not only its type
            return "{" + ",".join(f"{k}:{shapes(v)}" for k, v in sorted(obj.items())) + "}"
        return type(obj).__name__

    parts.append(shapes(sample))
    h.update("\n".join(parts).encode())
    return h.hexdigest()[:20]


def device_key(device: torch.device) -> str:
    """What the measurement depends on besides the model: the device (and CPU threads)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda {props.name} cc{props.major}.{props.minor} cuda{torch.version.cuda}"
    return f"cpu {cpu_identity()[0]} x{torch.get_num_threads()} threads"


def _cache_path(signature: str, key: str) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    slug = hashlib.sha256(key.encode()).hexdigest()[:12]
    return root / f"{signature}-{slug}.json"


def read_cache(path: Path | None, key: str) -> tuple[DeviceProfile | None, str | None]:
    """The profile cached at `path` for device `key`, or (None, why not) when it must be measured
    again: unreadable, from another version, or measured on another CPU/host (a copied cache
    directory). Never raises: a bad cache costs a measurement, not the run."""
    if path is None or not path.is_file():
        return None, None
    try:
        profile = DeviceProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        return None, f"the cached profile {path.name} was unreadable ({type(e).__name__}): measured again"
    if profile.device != key:
        return None, f"the cached profile {path.name} is of {profile.device!r}, not this {key!r}: measured again"
    return profile, None


def _write_cache(path: Path | None, profile: DeviceProfile) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, profile.to_json())   # ranks writing the same file never leave half of one
    except OSError:
        pass                    # a read-only home is not a reason to fail a run


# -- measuring --------------------------------------------------------------------------------
def _sizes(limit: int) -> list[int]:
    sizes, m = [], 1
    while m < limit:
        sizes.append(m)
        m *= 2
    sizes.append(limit)
    return sorted(set(sizes))


def measure(model: torch.nn.Module, optimizer, load: Callable[[int], object], *, device: torch.device,
            label: str, forward: Callable = default_forward, precision: str = "fp32",
            memory_bytes: int | None = None, max_size: int = MAX_SIZE, cpu_clock: bool = False,
            budget_s: float = 5.0, throttle=None, pace=None) -> DeviceProfile:
    """Measure this device; the model's parameters, gradients, buffers and RNG are left as found.

    `load(m)` returns a batch of m samples on `device`. `cpu_clock`: time with this thread's CPU
    time (emulated devices) instead of the wall clock. `throttle`: an emulated device's throttle
    on the controlled clock (a fresh one: its books change), through which every forward and
    backward runs, timed by its busy time (CPU + sleeps). `pace`: an emulated device's throttle on
    the CPU's own clock (a fresh one), through which `paced_cost` is measured (module docstring)."""
    cuda = device.type == "cuda"
    dtype = DTYPES.get(precision)

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def fwd(m, b):
        with autocast():
            return forward(m, b)

    clocked = throttle is not None and throttle.clocked and not cuda
    clock = throttle.busy if clocked else clocks.thread_cpu if cpu_clock and not cuda else clocks.host
    now = _synced(clock, device)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    started = clocks.host()
    with torch.random.fork_rng(devices=[device] if cuda else []):
        # The emulator's meter, as training uses it: parameters are model state, not activations.
        meter = MemoryMeter(label="profile", cap=None)
        meter.set_fixed(model, None)

        def activations(m: int) -> float:
            """Bytes the forward of m samples keeps for backward: on CUDA the allocator's peak over
            the forward (what the forward left allocated, plus its temporaries); elsewhere the
            saved tensors the emulator's meter counts."""
            batch = load(m)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                loss = as_scalar(fwd(model, batch))
                torch.cuda.synchronize(device)
                used = torch.cuda.max_memory_allocated(device) - base
            else:
                with meter.forward():
                    loss = as_scalar(fwd(model, batch))
                used = meter.activations
            loss.backward()
            return float(used)

        # Activation bytes at two sizes: c + d·m (autocast's low-precision weight copies are the c).
        # A model that cannot train on one sample (BatchNorm needs two) starts at two.
        first = 1
        try:
            at_first = activations(1)
        except ValueError:
            first = 2
            at_first = activations(2)
        state_guess = model_state_bytes(model, optimizer)
        limit = max(first, max_size)
        if memory_bytes is not None:
            room = (memory_bytes - state_guess) / max(at_first / first, 1.0)
            limit = max(first, min(limit, int(room // 2)))
        sizes = [m for m in _sizes(limit) if m >= first]
        act_fixed, act_per = fit_linear([first, sizes[-1]], [at_first, activations(sizes[-1])]) \
            if sizes[-1] > first else (0.0, at_first / first)

        timed_sizes, seconds, forward_parts, cpu_seconds = [], [], [], []
        for m in sizes:
            batch = load(m)
            runs, cpu_runs = [], []
            for k in range(MAX_RUNS + 1):
                t0, c0 = now(), clocks.thread_cpu()
                # Without the emulated meter's hooks: training counts a forward's activations once
                # and then looks them up (emulate.MemoryMeter), so the hooks are not its cost.
                loss = as_scalar(fwd(model, batch))
                t1, forward_cpu = now(), clocks.thread_cpu() - c0
                if clocked:                  # the device's clock, as training runs it (Throttle)
                    guess = throttle.before_backward(forward_cpu, samples=m)
                c1 = clocks.thread_cpu()
                loss.backward()
                if clocked:
                    throttle.after_backward(forward_cpu, guess, clocks.thread_cpu() - c1)
                    throttle.settle()
                spent, cpu = now() - t0, clocks.thread_cpu() - c0
                if k == 0:
                    continue                 # warm-up: a new size allocates (and faults in) new memory
                runs.append(spent)
                cpu_runs.append(cpu)
                # the forward's part of the work (on the clock, of its CPU work: cost.py's use)
                forward_parts.append(forward_cpu / max(cpu, 1e-12) if clocked else (t1 - t0) / max(spent, 1e-12))
                if sum(runs) >= MIN_TIMED_S:
                    break
            timed_sizes.append(m)
            seconds.append(statistics.median(runs))
            cpu_seconds.append(statistics.median(cpu_runs))
            if clocks.host() - started > budget_s and len(timed_sizes) >= 2:
                break                        # bounded: fit what was measured
        optimizer_s, fixed = _time_optimizer(model, optimizer, device, clock, cuda,
                                             pace=throttle.compute if clocked else contextlib.nullcontext)
        paced = {}
        if pace is not None and not clocked and not cuda:
            quick = [m for m, t in zip(timed_sizes, cpu_seconds) if t <= PACED_PASS_S] or timed_sizes[:1]
            paced["paced_cost"] = paced_cost(model, load(quick[-1]), fwd, pace)
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    a, b = fit_linear(timed_sizes, seconds)
    what = ("busy time on its controlled clock (CPU + sleeps)" if clocked else
            "CPU time of one thread" if clock is clocks.thread_cpu else "wall time")
    share = {"cpu_share": min(1.0, sum(cpu_seconds) / sum(seconds))} if clocked and sum(seconds) > 0 else {}
    return DeviceProfile(
        device=label, source=f"measured on {label} ({what}, {len(timed_sizes)} sizes up to {timed_sizes[-1]})",
        overhead_s=a, per_sample_s=b, optimizer_s=optimizer_s, fixed_bytes=fixed, **share,
        activation_bytes_per_sample=act_per, activation_fixed_bytes=act_fixed,
        memory_bytes=memory_bytes, precision=precision, forward_fraction=statistics.median(forward_parts),
        sizes=tuple(timed_sizes), seconds=tuple(seconds), **paced)


def _synced(clock: Callable[[], float], device: torch.device) -> Callable[[], float]:
    """The clock, read after the device has finished its queued work (CUDA runs asynchronously)."""
    if device.type != "cuda":
        return clock

    def now() -> float:
        clocks.synchronize(device)
        return clock()
    return now


def _time_optimizer(model, optimizer, device, clock, cuda, pace=contextlib.nullcontext) -> tuple[float, int]:
    """Seconds of one optimizer step, timed on a copy of the optimizer over copies of the
    parameters, and the fixed bytes (parameters, gradients, optimizer state) after a step.
    `pace`: how the device runs the step (an emulated device on its clock: its throttle)."""
    if optimizer is None:
        return 0.0, model_state_bytes(model, None)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    need = sum(p.numel() * p.element_size() for p in params) * 4
    if cuda and torch.cuda.mem_get_info(device)[0] < 2 * need:
        # No room for a copy: state as AdamW would hold it, time unknown (bandwidth-bound, small).
        return 0.0, model_state_bytes(model, optimizer) + 2 * sum(p.numel() * p.element_size() for p in params
                                                                  if p.requires_grad)
    twin = copy.deepcopy(optimizer)
    for original, clone in zip(params, (p for g in twin.param_groups for p in g["params"])):
        if not original.requires_grad:
            continue             # frozen (a LoRA base in AdamW(model.parameters())): never stepped, no state
        clone.grad = original.grad.detach().clone() if original.grad is not None else torch.zeros_like(clone)
    runs = []
    now = _synced(clock, device)
    for _ in range(3):
        t0 = now()
        with pace():
            twin.step()
        runs.append(now() - t0)
    state = [v for s in twin.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    fixed = model_state_bytes(model, None) + sum(t.numel() * t.element_size() for t in state)
    del twin
    return min(runs[1:]), fixed       # the first step allocates the state


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


def profile_device(model: torch.nn.Module, optimizer, load: Callable[[int], object], *, device: torch.device,
                   label: str, forward: Callable = default_forward, precision: str = "fp32",
                   memory_bytes: int | None = None, max_size: int = MAX_SIZE,
                   emulate: ClusterDevice | None = None, throttle=None) -> tuple[DeviceProfile, bool]:
    """This device's profile, from the cache when this model was measured on this device before.
    Returns (profile, came_from_cache). `throttle`: the emulated device's own, when it runs on the
    controlled clock (a fresh copy of it times the device; see the module's docstring)."""
    sample = load(1)
    if emulate is not None:
        memory_bytes = emulate.memory_bytes
    on_clock = emulate is not None and throttle is not None and throttle.clocked
    signature = model_signature(model, optimizer, sample, precision=precision, max_size=max_size)
    key = device_key(device) + (f" cap{memory_bytes}" if memory_bytes else "")
    # a device at speed 1 never sleeps: nothing to pace (its ratio would be noise clamped upward)
    paced = (emulate is not None and throttle is not None and not on_clock and device.type != "cuda"
             and throttle.speed < 1)
    if on_clock:      # its times are this clock's at this speed: kept apart from any other's
        clock = hashlib.sha256(repr((throttle.sample_s, throttle.micro_s, throttle.speed)).encode()).hexdigest()[:10]
        key += f" clock {clock}"
    elif paced:       # its paced_cost is this speed's (the sleep's length)
        key += f" speed {throttle.speed:g}"
    path = _cache_path(signature, key)
    raw, note = read_cache(path, key)
    cached = raw is not None
    if raw is None:
        raw = measure(model, optimizer, load, device=device, label=key, forward=forward, precision=precision,
                      memory_bytes=memory_bytes, max_size=max_size, cpu_clock=emulate is not None,
                      throttle=throttle.fresh() if on_clock else None,
                      pace=throttle.fresh() if paced else None)
        _write_cache(path, raw)
    if on_clock:
        profile = clocked(raw, emulate)
    elif emulate is not None:
        profile = emulated(raw, emulate)
    else:
        profile = replace(raw, device=label, memory_bytes=memory_bytes,
                          source=raw.source.replace(f"measured on {key}", f"measured on {label}"))
    if note:            # said where the profile's origin is said: the plan's reasons
        profile = replace(profile, source=f"{profile.source} ({note})")
    return profile, cached
