"""The controlled clock the benchmarks share, and the demo GPT it is calibrated on.

An emulated device's compute lasts what the CPU took ÷ its speed (the wall clock), or, on a
controlled clock, a micro-batch of m samples lasts m·T/speed (runtime/devices/emulation.Throttle's
`sample_s`, `hetrain.init(emulate_sample_s=)`, as the tests use it): the CPU still computes every
sample and the sleep makes up the rest. Everything outside the emulated forward and backward (the
gradient sync, the optimizer's CPU time ÷ speed, the loop's own work per step) stays on the wall
clock.

Why a clock: an emulated device stands for a GPU, whose speed holds from one minute to the next;
a virtual CPU's does not. On a 2-core AMD EPYC VM (avx512_bf16), one process training the demo
GPT alone took 110-165 ms a step in bf16 in phases of seconds, and `benchmarks/host_drift.py`
measured a 2-s probe of two processes computing at once up to 32% off that phase's mean. On the
wall clock every figure that compares two runs, or a prediction from a probe of seconds with a run
a minute later, carries that drift; on the controlled clock the devices keep their speeds as GPUs
do, and what is left to compare is what the benchmark is about (the split, the micro-batches, the
sync, the optimizer, each side's overheads).

T must exceed the CPU's own time per sample with the devices computing at once, or a device runs
slower than asked and the drift comes back: `--clock auto` sets T to 3× the fast device's
forward+backward CPU time per sample, measured first in the driver (median of 8 steps at the
given micro-batch, under the precision the card computes in); the contention measured between two
devices at job starts on that VM was x1.00-1.66. `--clock wall` keeps the wall clock, `--clock 10`
a 10 ms clock.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

FAST = "a100-80g:1.0"     # the device the clock is calibrated on (speed 1)


# -- the demo GPT, as the benchmarks train it ------------------------------------------------
def model_and_data(*, seq_len: int, d_model: int, layers: int):
    """The demo GPT (hetrain.demo.gpt) and the pydoc text windows it trains on."""
    import torch

    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=seq_len, d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 32)))
    return model, ByteWindows(pydoc_bytes(), seq_len)


def loss_of(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def card_autocast(precision: str, spec: str, rank: int = 0):
    """What a careful user runs on rank `rank`'s card of the cluster `spec`, by hetrain's rule:
    autocast to the card's precision (or the precision asked for), computed in fp32 where this
    host's CPU runs it slowly."""
    import torch

    from hetrain.hardware.cluster import parse_cluster
    from hetrain.hardware.host import host_facts
    from hetrain.runtime.devices.emulation import EmulatedDevice
    from hetrain.runtime.devices.precision_policy import PrecisionPolicy

    policy = PrecisionPolicy.local(precision, device=torch.device("cpu"), host=host_facts(),
                                   emulated=EmulatedDevice(parse_cluster(spec)[rank]))
    if policy.error is not None:
        raise policy.error
    dtype = policy.dtype
    return (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else contextlib.nullcontext


# -- the clock ------------------------------------------------------------------------------
def add_clock_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clock", default="auto",
                   help="auto (default): a controlled clock, every emulated micro-batch of m samples lasting "
                        "m x T / speed, T calibrated here; a number: T in ms; wall: the CPU's time / speed "
                        "(benchmarks/controlled_clock.py says why)")
    p.add_argument("--clock-ms", type=float, default=None, help=argparse.SUPPRESS)   # the workers' T


def resolve_clock(args, p: argparse.ArgumentParser, *, micro_batch: int) -> None:
    """Set args.clock_ms from --clock (None: the wall clock); `auto` calibrates here, on the model
    args.seq_len, args.d_model, args.layers at the fast device's `micro_batch`, and says what it
    chose. Bad values: one line, exit 2."""
    if args.clock == "wall":
        args.clock_ms = None
    elif args.clock == "auto":
        args.clock_ms, cpu_ms = calibrate_clock_ms(precision=args.precision, micro_batch=micro_batch,
                                                   seq_len=args.seq_len, d_model=args.d_model, layers=args.layers)
        print(f"clock: {args.clock_ms:g} ms a sample at speed 1 (3x the {cpu_ms:.2f} ms of CPU a sample "
              f"the fast device's forward and backward took here)", flush=True)
    else:
        try:
            args.clock_ms = float(args.clock)
        except ValueError:
            p.error(f"--clock {args.clock!r}: give auto, wall, or the ms a sample takes at speed 1 (e.g. 10)")
        if not 0 < args.clock_ms <= 1000:
            p.error(f"--clock {args.clock}: give a positive number of ms, at most 1000")


def clock_s(args) -> float | None:
    """--clock-ms as seconds per sample at speed 1 (None: the wall clock, devices as fast as the CPU)."""
    return args.clock_ms / 1000 if getattr(args, "clock_ms", None) else None


def describe_clock(args) -> str:
    return (f"controlled: {args.clock_ms:g} ms a sample at speed 1" if getattr(args, "clock_ms", None)
            else "wall: each device's CPU time / its speed")


def calibrate_clock_ms(*, precision: str, micro_batch: int, seq_len: int = 64, d_model: int = 128,
                       layers: int = 4) -> tuple[float, float]:
    """(the controlled clock's ms a sample at speed 1, the CPU ms a sample it comes from): the fast
    device's forward + backward CPU time per sample in this process, one thread, at `micro_batch`
    and the precision it computes in (median of 8 steps after 3), ×3 rounded up to 0.5 ms."""
    import torch

    torch.set_num_threads(1)
    model, data = model_and_data(seq_len=seq_len, d_model=d_model, layers=layers)
    autocast = card_autocast(precision, FAST)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = max(1, micro_batch)
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(n))))
    per_sample = []
    for step in range(11):
        t = time.thread_time()
        with autocast():
            loss = loss_of(model, x, y)
        loss.backward()
        if step >= 3:
            per_sample.append((time.thread_time() - t) / n)
        opt.step()
        opt.zero_grad(set_to_none=True)
    cpu_ms = statistics.median(per_sample) * 1e3
    return math.ceil(3 * cpu_ms * 2) / 2, cpu_ms
