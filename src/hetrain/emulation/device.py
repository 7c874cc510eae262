"""Emulated devices: a CPU process that computes like a slower GPU with a smaller memory.

Speed. One CPU thread plays the fastest device (see hardware/cluster.py); a device of relative
speed s sleeps c·(1/s − 1) for every piece of compute that took c seconds of this thread's CPU
time, so its compute lasts c/s. CPU time (not wall time) is measured, so time spent waiting for
peers in a collective is never throttled. The sleep comes before the backward of a step's last
micro-batch, for all the step's compute (Throttle).

Memory. Parameters, gradients and optimizer state are counted from their tensors; activations
are counted as the forward saves them for backward (`saved_tensors_hooks`). When the total would
pass the cap, the forward raises `torch.OutOfMemoryError` — the same type a CUDA OOM raises — so
the recovery code that handles it is the real one. An OOM, the cap's or an injected one, leaves
the failed graph held and the device full until the graph is released (held_memory.py): a
recovery that allocates before releasing fails a second time, as on a GPU.

The process. A device is one CPU thread (`become_emulated_device`), and glibc keeps the memory a
step frees: left to itself it returns freed blocks to the system and the next step faults them in
again, 0-3,800 minor faults a step on a 2-core VM (whichever way the heap had settled), each ~5 µs
of this thread's CPU, which the throttle charges as the device's compute. The profiler's repeated
passes fault almost none, so a run read slower than its plan; a GPU's caching allocator never pays
it. Kept, four interleaved runs of a dilated A100 + 3090 pair each trained 1.1-9.0% faster and
faulted 0 times a step.

Counting costs: a Python hook on every saved tensor (and its unpack in the backward) made a
forward+backward of the demo GPT 3.7% slower on the CPU, a cost no GPU has. So a forward whose
inputs have shapes the meter has seen is counted once and then looked up (`forward(signature)`):
the same graph saves the same bytes. It is counted again every RECOUNT_EVERY forwards, keeping
the largest count (a graph that varies with the data is caught within that many forwards), and
whenever the looked-up total would not fit, so an OOM is still raised from inside the forward, at
the tensor that crossed the cap. Inputs the signature cannot describe are always counted.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager

import torch

from ..hardware.cluster import ClusterDevice
from ..hardware.units import format_bytes
from ..runtime.devices import clock
from ..runtime.devices.saved_bytes import (  # noqa: F401 -- tensor_bytes, optimizer_state_tensors: names kept here
    local_part as _local, model_state_bytes, optimizer_state_tensors, tensor_bytes)
from .held_memory import Ledger, Saved

# glibc's mallopt(3) parameters (malloc.h), and what an emulated device sets them to
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 2**30           # free memory at the heap's top before glibc returns it
MMAP_FROM_BYTES = 32 * 2**20       # blocks below this come from the heap (glibc's largest allowed)
RECOUNT_EVERY = 50     # forwards of one input signature between two counts of their activations
MAX_SIGNATURES = 64    # signatures remembered (inputs that differ every time are simply counted)
ASYNC_ENV = "HETRAIN_EMULATE_ASYNC"   # 1: emulated devices pay their sleeps at the sync points only


def become_emulated_device() -> bool:
    """This process plays one emulated device: one CPU thread, and glibc keeping the memory it
    frees (see the module docstring). Returns whether glibc took it (False off glibc, e.g. macOS:
    the device then pays the faults, as before)."""
    torch.set_num_threads(1)
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES) and mallopt(M_MMAP_THRESHOLD, MMAP_FROM_BYTES))


class MemoryMeter:
    """Counts the bytes a device holds; raises OutOfMemoryError past `cap` (None: count only)."""

    def __init__(self, *, label: str, cap: int | None):
        self.label = label
        self.cap = cap
        self.fixed = 0            # parameters, gradients, optimizer state (+ transient)
        self.transient = 0        # held only while computing: FSDP2's unsharded units (set by the wrapper)
        self.saved_is_state = None  # predicate: a saved tensor that is model state, not an activation
        self.activations = 0      # saved by the forward in flight
        self.peak = 0
        self.step_peak = 0        # the most held since start_step() (the metrics' memory per step)
        self._seen: set[int] = set()
        self._skip: set[int] = set()  # storages that are already counted as fixed (parameters)
        self._counted: dict[object, list[int]] = {}   # signature: [activation bytes, forwards since]
        self.hooked_forwards = 0      # forwards counted tensor by tensor (the rest were looked up)
        self.ledger = Ledger(label)   # what the graphs hold, and an OOM's failed graph (held_memory.py)
        self.count_next = False       # count the next forward tensor by tensor (an OOM is due in it)

    def reach(self, total: int) -> None:
        self.peak = max(self.peak, total)
        self.step_peak = max(self.step_peak, total)

    def start_step(self) -> None:
        self.step_peak = self.fixed

    def set_fixed(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.fixed = model_state_bytes(model, optimizer) + self.transient
        self._skip = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.reach(self.fixed)

    def _pack(self, t: torch.Tensor):
        storage = _local(t).untyped_storage()    # a DTensor (TP, FSDP2) saves its local shard
        ptr = storage.data_ptr()
        if ptr in self._skip or (self.saved_is_state is not None and self.saved_is_state(ptr)):
            return t
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.activations += storage.nbytes()
            total = self.fixed + self.activations
            self.reach(total)
            if self.cap is not None and total > self.cap:
                self.out_of_memory()
                raise torch.OutOfMemoryError(
                    f"{self.label}: out of memory (emulated): needs {format_bytes(total)} "
                    f"({format_bytes(self.fixed)} model state + {format_bytes(self.activations)} "
                    f"activations so far), cap {format_bytes(self.cap)}")
        return self.ledger.hold(t, ptr, storage.nbytes())

    def out_of_memory(self) -> None:
        """An OOM strikes now (the cap, or an injected fault): the graph in flight stays held, and
        the device full, until it is released (held_memory.py)."""
        self.ledger.out_of_memory()

    def allocating(self):
        """Meter a recovery's allocations: an OOM while the failed graph is still held."""
        return self.ledger.allocating()

    @contextmanager
    def forward(self, signature: object = None):
        """Count one forward's saved activations (they are freed by its backward). With a
        `signature` (hashable: the inputs' shapes, dtypes, grad and autocast modes), a forward
        seen before is looked up instead while it fits (see the module's docstring)."""
        known = self._counted.get(signature) if signature is not None else None
        count_now, self.count_next = self.count_next, False
        if known is not None and known[1] + 1 < RECOUNT_EVERY and not count_now and (
                self.cap is None or self.fixed + known[0] <= self.cap):
            known[1] += 1
            self.activations = known[0]
            yield self
            self.reach(self.fixed + known[0])
            return
        self._seen.clear()
        self.activations = 0
        self.hooked_forwards += 1
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self
        if signature is not None and (known is not None or len(self._counted) < MAX_SIGNATURES):
            # completed: remember what this graph saves (the most any count of it found)
            self._counted[signature] = [max(self.activations, known[0] if known else 0), 0]


def _unpack(packed):
    return packed.tensor if isinstance(packed, Saved) else packed


class Throttle:
    """Makes this thread's compute last c/speed by sleeping c·(1/speed − 1) for c seconds of CPU.

    Where the sleep goes matters as much as how long it is. A real slow GPU hands its gradients
    to the all-reduce late; a sleep placed after the backward would let the gradient sync start
    early and then stall the peers at the next collective instead. So the loop sleeps *before*
    the backward of the step's last micro-batch (the one whose backward syncs), for everything the
    step computed so far plus a prediction of that backward (its learned ratio to the forward),
    and books the prediction's error as a debt paid at the next sleep. Earlier micro-batches only
    book their time: a sleep between every forward and backward left the next compute on cold
    caches (+1–5 ms of CPU per micro-batch here, times 1/speed in emulated time), which no GPU
    has. Peers see no difference as long as no collective runs between a step's start and its
    last backward (DDP's buffer broadcast and FSDP2's gathers in the first forward come before any
    sleep is owed; a model with a collective in every forward, such as SyncBatchNorm, would see
    the slow device's delay at its last forward instead of spread over its micro-batches).

    A controlled clock (`sample_s`, and `micro_s` seconds per micro-batch whatever its size; for
    tests and benchmarks that need a timing relation to hold on any host and under load): a
    micro-batch of m samples then lasts (micro_s + m·sample_s)·slowdown/speed, whatever its CPU
    took; the CPU still computes it for real, and the sleep makes up the difference (a CPU slower
    than the clock shows as a device slower than asked, never as a negative sleep). Nothing else
    is told the clock: the profiler times a device on it as training does (a `fresh()` throttle,
    its forward and backward through `before_backward`/`after_backward`, the time being the
    thread's CPU time plus the sleeps, as the device's hooks count busy time).

    Asynchronous (`asynchronous=True`, HETRAIN_EMULATE_ASYNC=1): the device's work completes after
    the host call returns, as a GPU's does. `settle()` then sleeps nothing; what is owed is slept
    at the next sync point (devices/clock.py: a synchronize, a collective hetrain issues), where
    a GPU's host would wait for it. Its time is still the device's: `charged_s` holds it from the
    moment it is charged, and its clock (clock.EmulatedClock) reads it; a host clock around the op does
    not see it, as it does not see a CUDA kernel.
    """

    def __init__(self, speed: float, *, seed: int = 0, sample_s: float | None = None,   # seed: per device
                 micro_s: float | None = None, asynchronous: bool = False):
        if not 0 < speed <= 1:
            raise ValueError(f"emulated speed must be in (0, 1], got {speed}")
        if sample_s is not None and not sample_s > 0:
            raise ValueError(f"the controlled clock's seconds per sample must be positive, got {sample_s}")
        if micro_s is not None and (sample_s is None or not micro_s >= 0):
            raise ValueError(f"the controlled clock's seconds per micro-batch must be >= 0, on a clock "
                             f"(sample_s), got {micro_s}")
        self.speed = speed
        self.sample_s = sample_s
        self.micro_s = micro_s or 0.0
        self._seed = seed
        self.slowdown = 1.0         # extra multiplier on compute time (fault injection)
        self.noise = 0.0            # ±amplitude of random timing noise around its mean (faults)
        self._rng = random.Random(seed)
        self.cpu_seconds = 0.0      # compute measured (unthrottled)
        self.slept_seconds = 0.0
        self.overslept_s = 0.0      # the host's lateness waking from those sleeps: its time, not the device's
        self.owed = 0.0             # sleep charged but not yet slept (negative: slept ahead)
        self.backward_ratio = 2.0   # backward CPU time / forward CPU time, learned
        self.asynchronous = asynchronous
        if asynchronous:
            clock.owe(self)

    @property
    def charged_s(self) -> float:
        """The device time charged beyond the CPU's: slept, or owed to the next sync."""
        return self.slept_seconds + self.owed

    def ahead_s(self, wall: bool) -> float:
        """What the device's clock adds to its base (clock.EmulatedClock): the compute charged beyond
        the CPU's; on the wall base less what was slept, which the wall time holds already, and less
        the host's lateness waking from those sleeps (on a busy host, milliseconds a sleep): the
        device's time is what it charged, not when this process next got a core."""
        return self.charged_s - (self.slept_seconds + self.overslept_s if wall else 0.0)

    def waited_s(self) -> float:
        return self.slept_seconds

    @property
    def clocked(self) -> bool:
        return self.sample_s is not None

    def fresh(self) -> Throttle:
        """A throttle of the same device and clock with books of its own (for a probe: the
        device's throttle keeps the training's)."""
        return Throttle(self.speed, seed=self._seed, sample_s=self.sample_s,
                        micro_s=self.micro_s if self.sample_s is not None else None, asynchronous=self.asynchronous)

    def pace(self):
        """A fresh pace of this device for a probe (profiling.EmulatedPace over `fresh()`)."""
        from .profiling import EmulatedPace

        return EmulatedPace(self.fresh())

    def busy(self) -> float:
        """This thread's CPU time plus the device time charged (slept or owed): the device's busy
        time (devices/hooks.py)."""
        return clock.thread_cpu() + self.charged_s

    def _stretch(self) -> float:
        """Emulated seconds per CPU second, beyond the CPU second itself."""
        noise = 1 + 2 * self.noise * self._rng.random() if self.noise else 1.0
        return self.slowdown * noise / self.speed - 1

    def charge(self, cpu_seconds: float) -> None:
        """Book compute; its sleep is owed until the next settle()."""
        self.cpu_seconds += cpu_seconds
        self.owed += cpu_seconds * self._stretch()

    def settle(self) -> None:
        """Where a synchronous device sleeps what it owes; an asynchronous one waits for a sync."""
        if not self.asynchronous:
            self.sync()

    def sync(self) -> None:
        """The host waits for the device: sleep what is owed."""
        if self.owed > 0:
            self.slept_seconds += self.owed
            t0 = time.perf_counter()
            time.sleep(self.owed)
            self.overslept_s += max(0.0, time.perf_counter() - t0 - self.owed)
            self.owed = 0.0

    def pay(self, cpu_seconds: float) -> None:
        self.charge(cpu_seconds)
        self.settle()

    def pay_clocked(self, length_s: float, cpu_seconds: float, wall_seconds: float) -> None:
        """A pipeline piece on the controlled clock: it lasts `length_s` (its rows' share of the
        clock at speed 1) ÷ speed, slowdown and noise included, the sleep making up what its wall
        time left. Its waits for a core are inside that wall time, so they come out of the sleep; a
        piece that outlasted its length shows as a slower device, never as a negative sleep."""
        self.cpu_seconds += cpu_seconds
        self.owed += max(0.0, length_s * (self._stretch() + 1) - wall_seconds)
        self.settle()

    @contextmanager
    def compute(self):
        """Throttle a piece of work that has no collective inside (e.g. the optimizer step)."""
        t0 = clock.thread_cpu()
        try:
            yield
        finally:
            self.pay(clock.thread_cpu() - t0)

    def before_backward(self, forward_cpu: float, *, settle: bool = True, samples: int = 1) -> float:
        """Book the forward and the predicted backward, and sleep for all that is owed (unless
        `settle` is False: a micro-batch whose backward does not sync); returns the prediction."""
        guess = self.backward_ratio * forward_cpu
        self._last_stretch = self._stretch()
        self.cpu_seconds += forward_cpu + guess
        if self.sample_s is not None:    # the controlled clock: the micro-batch lasts what it says
            length = self.micro_s + samples * self.sample_s
            self.owed += length * (self._last_stretch + 1) - (forward_cpu + guess)
            self._last_stretch = -1.0    # the backward's real CPU is already inside that length
        else:
            self.owed += (forward_cpu + guess) * self._last_stretch
        if settle:
            self.settle()
        return guess

    def after_backward(self, forward_cpu: float, guess: float, backward_cpu: float) -> None:
        """Book the backward's real CPU time in place of the guess (the same noise draw)."""
        self.cpu_seconds += backward_cpu - guess
        self.owed += (backward_cpu - guess) * self._last_stretch
        if forward_cpu > 1e-4:
            self.backward_ratio = 0.5 * self.backward_ratio + 0.5 * backward_cpu / forward_cpu


class EmulatedDevice:
    """This rank's emulated GPU: a throttle and a memory meter."""

    def __init__(self, spec: ClusterDevice, *, sample_s: float | None = None, micro_s: float | None = None,
                 asynchronous: bool | None = None):
        self.spec = spec
        if asynchronous is None:
            asynchronous = os.environ.get(ASYNC_ENV, "0").strip() not in ("", "0")
        self.throttle = Throttle(spec.speed, seed=1000 + spec.index, sample_s=sample_s, micro_s=micro_s,
                                 asynchronous=asynchronous)
        self.meter = MemoryMeter(label=f"{spec.label} (emulated)", cap=spec.memory_bytes)

    @property
    def label(self) -> str:
        return f"{self.spec.label} (emulated)"

    def precision_facts(self, host=None):
        """This device as the precision rule sees it (runtime/devices/precision_policy.device_facts):
        the catalog card's compute capability, computed on this CPU (`host`: hardware.host.HostFacts,
        how fast this CPU computes bf16 and fp16)."""
        from ..planning.precision import DeviceFacts

        slowdown = tuple((p, host.slowdown(p)) for p in ("bf16", "fp16")) if host is not None else ()
        return DeviceFacts(label=self.label, kind="emulated", capability=tuple(self.spec.gpu.precision_capability),
                           host_slowdown=slowdown, host="this CPU" if host is None else f"this CPU ({host.cpu})")


def agree_host_facts(*, rank: int, world_size: int):
    """This host's CPU facts (hardware/host.py), the same on every rank: rank 0 reads or measures
    them (one thread, nothing else computing yet) and hands them to all. An error there (a bad
    $HETRAIN_HOST_FACTS file) is raised on every rank, not on rank 0 alone."""
    import torch.distributed as dist

    from ..hardware.host import host_facts

    result: list = [None]
    if rank == 0:
        try:
            result = [host_facts()]
        except Exception as e:   # noqa: BLE001 — raised below, on every rank
            result = [e]
    if world_size > 1:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]
