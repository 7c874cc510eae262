"""The profiler: measures the user's model on this rank's device, before training, in bounded time.

For a few micro-batch sizes (1, 2, 4, … up to the largest that memory and the global batch allow)
it times forward + backward and fits t(m) = a + b·m; it counts the activation bytes at two sizes
(saved-tensor bytes off CUDA, `max_memory_allocated` over the forward on CUDA) and
fits c + d·m; it times one optimizer step on a copy of the optimizer (the model is never stepped)
and reads the fixed memory — parameters, gradients, optimizer state — off that copy. No
torch.distributed here: every rank measures its own device alone (the collective probes that
follow are sync_probes.py's).

Results are cached by model signature (architecture, parameter and batch shapes, optimizer type,
precision, torch version) and device (CUDA name, or CPU model and thread count) under
$HETRAIN_CACHE/profiles (default ~/.cache/hetrain/profiles; HETRAIN_CACHE=off disables it), so a
restart does not measure again.

A device measures itself as it states (its hooks' DeviceHooks.measuring, runtime/devices/measuring.py): the
memory its profile is given, its cache key, whether its compute is one thread's CPU time, a pace
of its own that every pass runs through and is timed by (a device that keeps its own time: the
fit is to that time, and `cpu_share` is the CPU seconds over it), further fields it measures
after the passes, and the profile made of the measurement. A GPU and a plain CPU are measured as
they are.
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
from ...hardware.host import cpu_identity
from ...planning.profile import DeviceProfile, fit_linear
from ..devices.precision_policy import DTYPES
from ..user_objects import as_scalar, default_forward
from ..devices.measuring import DeviceMeasuring, Pace
from ..devices.saved_bytes import SavedBytes, model_state_bytes

PROFILER_VERSION = 4             # 2: times forwards without the saved-bytes hooks (training looks them up);
                                # 3: frozen parameters in the optimizer get no state; 4: devices that keep
                                # their own time timed through their pace (paced profiles: their own key)
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
            budget_s: float = 5.0, timed_by: Pace | None = None, extras: Callable[..., dict] | None = None
            ) -> DeviceProfile:
    """Measure this device; the model's parameters, gradients, buffers and RNG are left as found.

    `load(m)` returns a batch of m samples on `device`. `cpu_clock`: time with this thread's CPU
    time instead of the wall clock. `timed_by`: a device that keeps its own time, its pace (a fresh
    one: its books change), through which every forward, backward and optimizer step runs, timed
    by its busy time. `extras(model, load, fwd, sizes=, cpu_seconds=)`: further profile fields the
    device measures after the passes (DeviceMeasuring.extra_measures)."""
    cuda = device.type == "cuda"
    dtype = DTYPES.get(precision)

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def fwd(m, b):
        with autocast():
            return forward(m, b)

    own = timed_by if timed_by is not None and not cuda else None
    clock = own.busy if own is not None else clocks.thread_cpu if cpu_clock and not cuda else clocks.host
    now = _synced(clock, device)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    started = clocks.host()
    with torch.random.fork_rng(devices=[device] if cuda else []):
        # Saved tensors, as a device without an allocator counts them: parameters are model state.
        saved = SavedBytes(model)

        def activations(m: int) -> float:
            """Bytes the forward of m samples keeps for backward: on CUDA the allocator's peak over
            the forward (what the forward left allocated, plus its temporaries); elsewhere the
            saved tensors counted."""
            batch = load(m)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                loss = as_scalar(fwd(model, batch))
                torch.cuda.synchronize(device)
                used = torch.cuda.max_memory_allocated(device) - base
            else:
                with saved.forward():
                    loss = as_scalar(fwd(model, batch))
                used = saved.activations
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
                # Without the saved-bytes hooks: training counts a forward's activations once and
                # then looks them up, so the hooks are not its cost.
                loss = as_scalar(fwd(model, batch))
                t1, forward_cpu = now(), clocks.thread_cpu() - c0
                if own is not None:          # the device's own time, as training runs it
                    guess = own.before_backward(forward_cpu, samples=m)
                c1 = clocks.thread_cpu()
                loss.backward()
                if own is not None:
                    own.after_backward(forward_cpu, guess, clocks.thread_cpu() - c1)
                    own.settle()
                spent, cpu = now() - t0, clocks.thread_cpu() - c0
                if k == 0:
                    continue                 # warm-up: a new size allocates (and faults in) new memory
                runs.append(spent)
                cpu_runs.append(cpu)
                # the forward's part of the work (on its own time, of its CPU work: cost.py's use)
                forward_parts.append(forward_cpu / max(cpu, 1e-12) if own is not None
                                     else (t1 - t0) / max(spent, 1e-12))
                if sum(runs) >= MIN_TIMED_S:
                    break
            timed_sizes.append(m)
            seconds.append(statistics.median(runs))
            cpu_seconds.append(statistics.median(cpu_runs))
            if clocks.host() - started > budget_s and len(timed_sizes) >= 2:
                break                        # bounded: fit what was measured
        optimizer_s, fixed = _time_optimizer(model, optimizer, device, clock, cuda,
                                             pace=own.compute if own is not None else contextlib.nullcontext)
        more = extras(model, load, fwd, sizes=timed_sizes, cpu_seconds=cpu_seconds) if extras and not cuda else {}
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    a, b = fit_linear(timed_sizes, seconds)
    what = (own.timing if own is not None else
            "CPU time of one thread" if clock is clocks.thread_cpu else "wall time")
    share = {"cpu_share": min(1.0, sum(cpu_seconds) / sum(seconds))} if own is not None and sum(seconds) > 0 else {}
    return DeviceProfile(
        device=label, source=f"measured on {label} ({what}, {len(timed_sizes)} sizes up to {timed_sizes[-1]})",
        overhead_s=a, per_sample_s=b, optimizer_s=optimizer_s, fixed_bytes=fixed, **share,
        activation_bytes_per_sample=act_per, activation_fixed_bytes=act_fixed,
        memory_bytes=memory_bytes, precision=precision, forward_fraction=statistics.median(forward_parts),
        sizes=tuple(timed_sizes), seconds=tuple(seconds), **more)


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
    `pace`: how the device runs the step (a device that keeps its own time: its pace's compute)."""
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


def profile_device(model: torch.nn.Module, optimizer, load: Callable[[int], object], *, device: torch.device,
                   label: str, forward: Callable = default_forward, precision: str = "fp32",
                   memory_bytes: int | None = None, max_size: int = MAX_SIZE,
                   measuring: DeviceMeasuring | None = None) -> tuple[DeviceProfile, bool]:
    """This device's profile, from the cache when this model was measured on this device before.
    Returns (profile, came_from_cache). `measuring`: what the device says of how it is measured
    (its hooks' DeviceHooks.measuring; None: measured as it is)."""
    measuring = measuring or DeviceMeasuring(device)
    sample = load(1)
    memory_bytes = measuring.memory_bytes(memory_bytes)
    signature = model_signature(model, optimizer, sample, precision=precision, max_size=max_size)
    key = measuring.profile_key(device_key(device) + (f" cap{memory_bytes}" if memory_bytes else ""))
    path = _cache_path(signature, key)
    raw, note = read_cache(path, key)
    cached = raw is not None
    if raw is None:
        raw = measure(model, optimizer, load, device=device, label=key, forward=forward, precision=precision,
                      memory_bytes=memory_bytes, max_size=max_size, cpu_clock=measuring.cpu_clock,
                      timed_by=measuring.timed_by(), extras=measuring.extra_measures)
        _write_cache(path, raw)
    profile = measuring.as_profile(raw, label=label, key=key, memory_bytes=memory_bytes)
    if note:            # said where the profile's origin is said: the plan's reasons
        profile = replace(profile, source=f"{profile.source} ({note})")
    return profile, cached
