"""`hetrain bench`'s runs: each device alone, the equal split, and hetrain, on the user's model.

Every configuration is a real job: benching/worker.py launched through hetrain's own launcher
(launch.py, torchrun), one process per device; on emulated devices gloo and CPU processes
throttled to each card's speed, on GPUs NCCL and one process per GPU (a device alone: its GPU
alone made visible).

Fair by design:
  * the same settings on both multi-device sides: hetrain's plan (made once, in the first round,
    from the job's own probes) and the equal split, which runs that plan with its shares made
    equal (the same engine, micro-batches and precision), both with rebalancing off, so the two
    figures differ by the split alone (rebalancing on would move the equal split back to
    hetrain's shares, and on one side only it would be a different job);
  * interleaved rounds (3 by default): every configuration once per round, the order reversed in
    every other round (A B C D, D C B A, A B C D: no configuration always runs first or just
    after another), and each figure is the median of its rounds, so a host whose speed drifts
    over the minutes of a bench moves every configuration alike;
  * the ceiling is printed beside them: the sum of every device's standalone figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UsageError
from ..files import write_json_atomic, write_text_atomic
from ..planning.plan import Plan, split_evenly

BUSY_LOAD = 0.5         # load average per core at the start above which the figures are called noisy
DEFAULT_ROUNDS = 3
EQUAL_SPLIT_HOW = ("hetrain's engine running an equal-split plan (every device the same share, its own "
                   "micro-batches, no rebalancing), not torch DDP")
HETRAIN_HOW = "hetrain's plan, made once from the job's own probes, run with rebalancing off (as the equal split)"


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
    rounds: int = DEFAULT_ROUNDS        # every configuration once per round; each figure is the median

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps} must be at least 1", "give the timed steps per run, e.g. --steps 20")
        if self.warmup < 0:
            raise UsageError(f"--warmup {self.warmup} is negative", "give 0 or more untimed steps, e.g. --warmup 2")
        if self.rounds < 1:
            raise UsageError(f"--rounds {self.rounds} must be at least 1",
                             f"give the interleaved rounds, e.g. --rounds {DEFAULT_ROUNDS} (each figure is their median)")
        if len(self.devices) < 2:
            raise UsageError(f"{len(self.devices)} device: nothing to split or compare",
                             "bench 2 or more devices: --emulate a100-80g,rtx3090, or a machine with 2+ GPUs")
        if self.global_batch < len(self.devices):
            raise UsageError(f"--global-batch {self.global_batch} is smaller than the {len(self.devices)} devices",
                             f"give at least one sample per device, e.g. --global-batch {16 * len(self.devices)}")

    @property
    def emulated(self) -> bool:
        return self.emulate is not None

    # what the devices are, said for people (benching/show.py: the table's title, the host line, the picture)
    @property
    def where(self) -> str:
        return f"emulated: {self.emulate}, on this CPU" if self.emulated else "this machine's GPUs"

    @property
    def host_note(self) -> str:
        return " (devices emulated: CPU processes throttled to each card's speed)" if self.emulated else ""

    @property
    def picture_note(self) -> str:
        return "\nemulated devices (CPU processes throttled to each card's speed), not real GPUs" if self.emulated else ""

    @property
    def configurations(self) -> int:
        return len(self.devices) + 2

    @property
    def phases(self) -> int:
        return self.rounds * self.configurations


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
    rounds: tuple[float, ...] = ()      # samples/s of every round, in round order (samples_per_s: their median)

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
                   rebalances=int(record.get("rebalances") or 0), plan=record["plan"],
                   rounds=(float(record["samples_per_s"]),))

    @classmethod
    def median_of(cls, runs: list[Run]) -> Run:
        """One configuration over its rounds: the median samples/s, every round's figure kept, the
        most memory any round held; shares and plan are the same in every round (the plan is fixed)."""
        first = runs[0]
        if first.error:
            return first
        peaks = tuple(max(r.peak_memory_bytes[i] for r in runs) for i in range(len(first.peak_memory_bytes)))
        return dataclasses.replace(first, samples_per_s=statistics.median(r.samples_per_s for r in runs),
                                   peak_memory_bytes=peaks, rebalances=sum(r.rebalances for r in runs),
                                   rounds=tuple(r.samples_per_s for r in runs))


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    setup: BenchSetup
    alone: tuple[Run, ...]              # per device, in the cluster's order
    equal_split: Run
    hetrain: Run
    host: dict
    orders: tuple[tuple[str, ...], ...] = ()   # each round's order of configurations, as run

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
                                   "micro_batches": list(r.micro_batches), "rounds": list(r.rounds),
                                   "peak_memory_bytes": list(r.peak_memory_bytes), "rebalance": False, **more}
        return {
            "model": s.factory, "devices": list(self.labels), "emulated": s.emulated, "emulate": s.emulate,
            "global_batch": s.global_batch, "steps": s.steps, "warmup": s.warmup, "precision": s.precision,
            "rounds": s.rounds, "orders": [list(o) for o in self.orders],
            "alone": [{"device": label, "samples_per_s": r.samples_per_s, "peak_memory_bytes": r.peak_memory_bytes[0],
                       "micro_batch": r.micro_batches[0], "rounds": list(r.rounds),
                       **({"error": r.error} if r.error else {})}
                      for label, r in zip(self.labels, self.alone)],
            "equal_split": multi(self.equal_split, how=EQUAL_SPLIT_HOW),
            "hetrain": multi(self.hetrain, rebalances=self.hetrain.rebalances, how=HETRAIN_HOW),
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


def round_order(names: list[str], round_index: int) -> list[str]:
    """Round 0, 2, 4...: as given; 1, 3...: reversed. Over rounds no configuration always runs
    first, nor always just after the same other one (a slow phase of the host is shared out)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def run_bench(setup: BenchSetup, *, say: Callable[[str], None]) -> BenchResult:
    """Every configuration once per round, in interleaved order; `say` gets a line as each starts.
    Round 1 runs each device alone, then hetrain (whose plan, written to a file, fixes both
    multi-device configurations from then on), then the equal split."""
    from ..hardware.host import host_facts

    load = _load_average()            # before any run of ours: what else this host is doing
    names = [f"alone{i}" for i in range(len(setup.devices))] + ["hetrain", "equal"]
    runs: dict[str, list[Run]] = {name: [] for name in names}
    orders: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory(prefix="hetrain-bench-") as tmp:
        plan_file, equal_file = os.path.join(tmp, "hetrain_plan.json"), os.path.join(tmp, "equal_plan.json")
        phase = iter(range(1, setup.phases + 1))
        for k in range(setup.rounds):
            order = round_order(names, k)
            orders.append(tuple(order))
            for name in order:
                head = f"[{next(phase)}/{setup.phases}]" + (f" round {k + 1}/{setup.rounds}:" if setup.rounds > 1 else "")
                if name.startswith("alone"):
                    i = int(name[len("alone"):])
                    device, what = setup.devices[i], f"device {i} alone ({setup.devices[i]}" + (
                        ", emulated)" if setup.emulated else ")")
                    if runs[name] and runs[name][0].error:      # it could not run it: once is enough
                        say(f"{head} {what}: skipped, it could not run it in round 1")
                        continue
                    say(f"{head} {what}: the global batch {setup.global_batch} on this one device")
                    runs[name].append(_launch(setup, tmp, f"{name}-{k}", what, config={}, device=device))
                    if runs[name][-1].error:
                        say(f"  {what} cannot run it: {runs[name][-1].error}; it counts 0 samples/s standalone")
                elif name == "hetrain":
                    planned = os.path.exists(plan_file)
                    say(f"{head} hetrain: " + ("its plan from round 1" if planned else
                                               f"the planner's split over {len(setup.devices)} devices"))
                    config = {"plan": plan_file} if planned else {}
                    runs[name].append(_launch(setup, tmp, f"{name}-{k}", "hetrain",
                                              config={**config, "rebalancing": {"enabled": False}}))
                    if not planned:
                        plan = Plan.from_json(json.dumps(runs[name][-1].plan))
                        write_text_atomic(plan_file, plan.to_json())
                        write_text_atomic(equal_file, equal_split_plan(plan).to_json())
                else:
                    say(f"{head} equal split: {EQUAL_SPLIT_HOW}")
                    runs[name].append(_launch(setup, tmp, f"{name}-{k}", "equal split",
                                              config={"plan": equal_file, "rebalancing": {"enabled": False}}))
            if k == 0 and all(runs[n][0].error for n in names if n.startswith("alone")):
                raise RunFailed(2)   # no device runs it alone; the reasons are printed above
    host = host_facts()
    facts = {**host.to_dict(), "cores": os.cpu_count(), "emulated": setup.emulated, "describe": host.describe(),
             "load_average_at_start": load}
    alone = tuple(Run.median_of(runs[f"alone{i}"]) for i in range(len(setup.devices)))
    return BenchResult(setup=setup, alone=alone, equal_split=Run.median_of(runs["equal"]),
                       hetrain=Run.median_of(runs["hetrain"]), host=facts, orders=tuple(orders))


def _launch(setup: BenchSetup, tmp: str, name: str, phase: str, *, config: dict, device: str | None = None) -> Run:
    """One configuration through hetrain's launcher; `device`: alone on that one device."""
    from ..launch import build_launch, run_launch

    from ..runtime.resilience.worker_errors import read_errors

    job, out = os.path.join(tmp, f"{name}.job.json"), os.path.join(tmp, f"{name}.result.json")
    run_dir = os.path.join(tmp, name)            # kept until the bench ends: a failed run's errors are read there
    write_json_atomic(job, {"factory": setup.factory, "phase": phase, "warmup": setup.warmup, "steps": setup.steps,
                            "out": out, "config": {"global_batch": setup.global_batch, "precision": setup.precision,
                                                   "reporting": {"verbose": False}, **config}})
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
