"""`hetrain bench`'s runs: each device alone, the equal split, and hetrain, on the user's model.

Every configuration is a real job: benching/worker.py launched through hetrain's own launcher
(launch.py, torchrun), one process per device; on emulated devices gloo and CPU processes
throttled to each card's speed, on GPUs NCCL and one process per GPU (a device alone: its GPU
alone made visible). The order is each device alone, hetrain, then the equal split, which runs
hetrain's plan with its shares made equal: the same engine, micro-batches and precision, so the
two multi-device figures differ by the split alone. Rebalancing is off for the equal split (it
would move the shares back to hetrain's) and on for hetrain, as a user runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UsageError
from ..files import write_json_atomic, write_text_atomic
from ..planning.plan import Plan, split_evenly

BUSY_LOAD = 0.5         # load average per core at the start above which the figures are called noisy
EQUAL_SPLIT_HOW = ("hetrain's engine running an equal-split plan (every device the same share, its own "
                   "micro-batches, no rebalancing), not torch DDP")


class RunFailed(Exception):
    """A configuration's job failed; the launcher has said why. `code`: its exit code."""

    def __init__(self, code: int):
        super().__init__(f"a benchmark run failed with exit code {code}")
        self.code = code


@dataclass(frozen=True, kw_only=True)
class BenchSetup:
    factory: str                        # the user's model factory, as given (FILE:FN or module:FN)
    emulate: str | None                 # the cluster spec; None: this machine's GPUs
    devices: tuple[str, ...]            # one launch target per device: its emulated spec, or its GPU id
    global_batch: int
    steps: int                          # timed steps per configuration
    warmup: int                         # untimed steps before them
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps} must be at least 1", "give the timed steps per run, e.g. --steps 20")
        if self.warmup < 0:
            raise UsageError(f"--warmup {self.warmup} is negative", "give 0 or more untimed steps, e.g. --warmup 2")
        if len(self.devices) < 2:
            raise UsageError(f"{len(self.devices)} device: nothing to split or compare",
                             "bench 2 or more devices: --emulate a100-80g,rtx3090, or a machine with 2+ GPUs")
        if self.global_batch < len(self.devices):
            raise UsageError(f"--global-batch {self.global_batch} is smaller than the {len(self.devices)} devices",
                             f"give at least one sample per device, e.g. --global-batch {16 * len(self.devices)}")

    @property
    def emulated(self) -> bool:
        return self.emulate is not None

    @property
    def phases(self) -> int:
        return len(self.devices) + 2


@dataclass(frozen=True, kw_only=True)
class Run:
    """One configuration's figures (rank 0's record from benching/worker.py)."""

    samples_per_s: float
    devices: tuple[str, ...]
    shares: tuple[int, ...]
    micro_batches: tuple[int, ...]
    peak_memory_bytes: tuple[int, ...]
    rebalances: int = 0                 # share changes during the run (hetrain's; the others run fixed shares)
    plan: dict = field(repr=False, default_factory=dict)
    error: str | None = None            # a device alone that could not run it (the model does not fit, say)

    @classmethod
    def failed(cls, device: str, error: str) -> Run:
        """A device alone that could not run the job: it adds nothing standalone."""
        return cls(samples_per_s=0.0, devices=(device,), shares=(0,), micro_batches=(0,), peak_memory_bytes=(0,),
                   error=error)

    @classmethod
    def from_record(cls, record: dict) -> Run:
        return cls(samples_per_s=float(record["samples_per_s"]), devices=tuple(record["devices"]),
                   shares=tuple(record["shares"]), micro_batches=tuple(record["micro_batches"]),
                   peak_memory_bytes=tuple(record["peak_memory_bytes"]),
                   rebalances=int(record.get("rebalances") or 0), plan=record["plan"])


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    setup: BenchSetup
    alone: tuple[Run, ...]              # per device, in the cluster's order
    equal_split: Run
    hetrain: Run
    host: dict

    @property
    def labels(self) -> tuple[str, ...]:
        """Each device as the hetrain run named it (the alone runs name theirs device #0)."""
        return self.hetrain.devices

    @property
    def sum_alone(self) -> float:
        return sum(r.samples_per_s for r in self.alone)

    @property
    def fastest_alone(self) -> int:
        """The index of the fastest device alone (run_bench stops when none could run)."""
        return max(range(len(self.alone)), key=lambda i: self.alone[i].samples_per_s)

    @property
    def speedup_vs_equal(self) -> float:
        return self.hetrain.samples_per_s / self.equal_split.samples_per_s

    @property
    def speedup_vs_fastest(self) -> float:
        return self.hetrain.samples_per_s / self.alone[self.fastest_alone].samples_per_s

    @property
    def efficiency(self) -> float:
        return self.hetrain.samples_per_s / self.sum_alone

    def to_dict(self) -> dict:
        s = self.setup
        multi = lambda r, **more: {"samples_per_s": r.samples_per_s, "shares": list(r.shares),  # noqa: E731
                                   "micro_batches": list(r.micro_batches),
                                   "peak_memory_bytes": list(r.peak_memory_bytes), **more}
        return {
            "model": s.factory, "devices": list(self.labels), "emulated": s.emulated, "emulate": s.emulate,
            "global_batch": s.global_batch, "steps": s.steps, "warmup": s.warmup, "precision": s.precision,
            "alone": [{"device": label, "samples_per_s": r.samples_per_s, "peak_memory_bytes": r.peak_memory_bytes[0],
                       "micro_batch": r.micro_batches[0], **({"error": r.error} if r.error else {})}
                      for label, r in zip(self.labels, self.alone)],
            "equal_split": multi(self.equal_split, how=EQUAL_SPLIT_HOW),
            "hetrain": multi(self.hetrain, rebalances=self.hetrain.rebalances),
            "sum_of_alone_samples_per_s": self.sum_alone,
            "speedup_vs_equal": self.speedup_vs_equal,
            "speedup_vs_fastest_alone": self.speedup_vs_fastest,
            "efficiency": self.efficiency,
            "host": self.host,
        }


def equal_split_plan(plan: Plan) -> Plan:
    """hetrain's plan with every device the same share (split_evenly: they differ by one at most
    when the batch does not divide), each device's micro-batch capped as hetrain's plan capped it."""
    shares = split_evenly(plan.global_batch, plan.world_size)
    devices = tuple(dataclasses.replace(
        d, share=s, micro_batch=min(s, d.max_micro_batch or s), predicted_compute_s=None, predicted_memory_bytes=None,
        reasons=(f"equal split: {s} of {plan.global_batch}, as plain DDP gives every device",))
        for d, s in zip(plan.devices, shares))
    return dataclasses.replace(plan, devices=devices, version=0, predicted={}, excluded=(),
                               note="equal split for `hetrain bench` (every device the same share)")


def run_bench(setup: BenchSetup, *, say: Callable[[str], None]) -> BenchResult:
    """Every configuration in turn; `say` gets a line as each one starts."""
    from ..hardware.host import host_facts

    load = _load_average()            # before any run of ours: what else this host is doing
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-") as tmp:
        phase = iter(range(1, setup.phases + 1))
        alone = []
        for i, device in enumerate(setup.devices):
            what = f"device {i} alone ({device}" + (", emulated)" if setup.emulated else ")")
            say(f"[{next(phase)}/{setup.phases}] {what}: the global batch {setup.global_batch} on this one device")
            alone.append(_launch(setup, tmp, f"alone{i}", what, config={}, device=device))
            if alone[-1].error:
                say(f"  {what} cannot run it: {alone[-1].error}; it counts 0 samples/s standalone")
        if all(r.error for r in alone):
            raise RunFailed(2)       # no device runs it alone; the reasons are printed above
        say(f"[{next(phase)}/{setup.phases}] hetrain: the planner's split over {len(setup.devices)} devices")
        het = _launch(setup, tmp, "hetrain", "hetrain", config={})
        plan_file = os.path.join(tmp, "equal_plan.json")
        write_text_atomic(plan_file, equal_split_plan(Plan.from_json(json.dumps(het.plan))).to_json())
        say(f"[{next(phase)}/{setup.phases}] equal split: {EQUAL_SPLIT_HOW}")
        equal = _launch(setup, tmp, "equal", "equal split", config={"plan": plan_file, "rebalance": False})
    host = host_facts()
    facts = {**host.to_dict(), "cores": os.cpu_count(), "emulated": setup.emulated, "describe": host.describe(),
             "load_average_at_start": load}
    return BenchResult(setup=setup, alone=tuple(alone), equal_split=equal, hetrain=het, host=facts)


def _launch(setup: BenchSetup, tmp: str, name: str, phase: str, *, config: dict, device: str | None = None) -> Run:
    """One configuration through hetrain's launcher; `device`: alone on that one device."""
    from ..launch import build_launch, run_launch

    from ..runtime.resilience.worker_errors import read_errors

    job, out = os.path.join(tmp, f"{name}.job.json"), os.path.join(tmp, f"{name}.result.json")
    run_dir = os.path.join(tmp, name)            # kept until the bench ends: a failed run's errors are read there
    write_json_atomic(job, {"factory": setup.factory, "phase": phase, "warmup": setup.warmup, "steps": setup.steps,
                            "out": out, "config": {"global_batch": setup.global_batch, "precision": setup.precision,
                                                   "verbose": False, **config}})
    if setup.emulated:
        launch = build_launch(target="hetrain.benching.worker", target_args=(job,), module=True,
                              emulate=device or setup.emulate, run_dir=run_dir)
    else:
        launch = build_launch(target="hetrain.benching.worker", target_args=(job,), module=True,
                              nproc=1 if device is not None else None, run_dir=run_dir)
        if device is not None:       # this GPU alone, counted as CUDA_DEVICE_ORDER=PCI_BUS_ID counts
            launch = dataclasses.replace(launch, env={**launch.env, "CUDA_VISIBLE_DEVICES": device})
    with _environment_kept():
        code = run_launch(launch)
    if code and device is not None:   # a device alone that cannot run the job: the others still can
        errors = read_errors(run_dir)
        return Run.failed(device, errors[0]["what"] if errors else f"its job exited with code {code}")
    if code:
        raise RunFailed(code)        # the workers' error, printed once by the launcher
    with open(out) as f:
        return Run.from_record(json.load(f))


@contextlib.contextmanager
def _environment_kept():
    """run_launch sets the job's variables in this process for torchrun's workers to inherit: put
    them back after each run, so one configuration's (a GPU made the only one visible) never
    reaches the next."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _load_average() -> float | None:
    """The host's 1-minute load average (None where the OS does not keep one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_host(host: dict) -> str | None:
    """A warning when other work was running as the bench started: its figures are then that
    work's as much as the devices' (each configuration runs at a different moment)."""
    load, cores = host.get("load_average_at_start"), host.get("cores") or 1
    if load is None or load < BUSY_LOAD * cores:
        return None
    return (f"this host was busy when the bench started (load average {load:.1f} on {cores} cores): the figures "
            "include that other work; run it again on an idle machine to compare the configurations")
