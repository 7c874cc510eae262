"""What the benchmarks share: --smoke, the controlled clock, the demo GPT it is calibrated on, a
cluster slowed D times. Not a benchmark (its name starts with _; tests/benchmarks runs the rest).

The controlled clock. An emulated device's compute lasts the CPU's time ÷ its speed (the wall
clock), or on a controlled clock a micro-batch of m samples lasts (a + m·T)/speed
(`hetrain.emulation.Emulation(sample_s=T, micro_s=a)`): the CPU still computes every sample and a sleep
makes up the rest. The planner is told nothing of it (docs/planning.md), so a benchmark comparing
a plan with a run checks the fit, the split and the micro-batches against devices whose speed
holds still, as a GPU's does and a shared virtual CPU's does not. a = 4·T (about what a small micro-batch costs a GPU in launches)
makes a device that runs many small micro-batches cost more than its rate says, so a profile or a
planner that ignored a would split wrongly. T must exceed the CPU's own time a sample with the
devices computing at once: `--clock auto` sets it to 3× the fast device's forward and backward
CPU time a sample, measured here first. `--clock wall`: the CPU's time; `--clock 10`: 10 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAST = "a100-80g:1.0"     # the device the clock is calibrated on (speed 1)
MICRO_SAMPLES = 4.0       # the clock's fixed part of a micro-batch, in samples' worth of T


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`prog: error: what, and the fix`), exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


# -- --smoke ------------------------------------------------------------------------------------
def add_smoke(p: argparse.ArgumentParser) -> None:
    p.add_argument("--smoke", action="store_true",
                   help="seconds: tiny sizes through the same code path (CI runs every benchmark so)")


def apply_smoke(p: argparse.ArgumentParser, args, **sizes) -> None:
    """With --smoke, set each size (an argument's dest: its smoke value) on `args`. A size flag
    given beside --smoke is named in one line: the smoke's size wins, so a smoke stays seconds."""
    if not getattr(args, "smoke", False):
        return
    given = [k for k in sizes if getattr(args, k, None) != p.get_default(k)]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        print(f"{p.prog}: {flags} ignored: --smoke sets its own sizes ("
              + ", ".join(f"{k.replace('_', '-')} {sizes[k]}" for k in given) + ")", file=sys.stderr)
    for k, v in sizes.items():
        setattr(args, k, v)


SIZE_HELP = {"rounds": "interleaved repetitions, every other one reversed", "steps": "timed steps per run"}


def add_sizes(p: argparse.ArgumentParser, **defaults) -> None:
    """--json, then an int flag for each size (an argument's dest: its default, or (default, help))."""
    p.add_argument("--json", help="write the figures here")
    for dest, default in defaults.items():
        default, help = default if isinstance(default, tuple) else (default, SIZE_HELP.get(dest))
        p.add_argument("--" + dest.replace("_", "-"), type=int, default=default, help=help)


def add_worker_args(p: argparse.ArgumentParser, *names: str, **choices) -> None:
    """The hidden flags a driver passes its workers: --worker (a switch, or one of `choices`'s
    modes), then each of `names` (clock-ms a float)."""
    p.add_argument("--worker", help=argparse.SUPPRESS, **(choices or {"action": "store_true"}))
    for name in names:
        p.add_argument(f"--{name}", help=argparse.SUPPRESS, **({"type": float} if name == "clock-ms" else {}))


def flags(args, *dests: str) -> list[str]:
    """`--dest value` for each of `dests` whose value is set: a worker's command line."""
    return [a for d in dests if getattr(args, d) is not None for a in ("--" + d.replace("_", "-"), str(getattr(args, d)))]


def torchrun(script: str, nproc: int, argv: list[str], *, per_rank: bool = False, env: dict | None = None,
             smoke: bool = False, preload: tuple[str, ...] = ()):
    """`script ARGV --out OUT` under torchrun --standalone on `nproc` ranks of one thread, its
    stdout dropped; the JSON at OUT (per_rank: each rank's at OUT.R, a list). smoke: the ranks
    forked instead (forked_ranks, its server importing `preload` too)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [*argv, "--out", str(out)]
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        if smoke:
            forked_ranks(script, nproc, argv, env=env, preload=preload)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
                   *argv]
            subprocess.run(cmd, check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nproc)] if per_rank else \
            json.loads(out.read_text())


# -- a smoke's ranks, forked ----------------------------------------------------------------------
# A rank under torchrun is a fresh interpreter importing torch and hetrain's runtime: ~5 s of CPU
# a rank on a 2-core CI host, most of a smoke's few steps, and torchrun's agent is one more. A
# smoke forks its ranks instead from one server that imported them once (as tests/harness.py's
# ranks are), each running the script's own worker (`script ARGV` as __main__) in the environment
# torchrun gives a rank of a single-node job. A full run keeps torchrun.
RANK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hetrain.runtime.engine"]


def _fork_context(preload: tuple[str, ...]):
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*RANK_PRELOAD, *preload])    # used when the server starts: the first forked_ranks
    return ctx


def _rank_main(script: str, argv: list[str], env: dict) -> None:
    import multiprocessing as mp
    import runpy

    # The server's environment is the driver's when it started: make it the driver's now.
    os.environ.clear()
    os.environ.update(env)
    mp.set_start_method("fork", force=True)     # a DataLoader's workers fork, as under torchrun
    import torch

    torch.set_num_threads(1)
    null = os.open(os.devnull, os.O_WRONLY)     # torchrun's stdout is dropped (torchrun() above)
    os.dup2(null, 1)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")     # a SystemExit's code is the rank's exit code


def forked_ranks(script: str, nproc: int, argv: list[str], *, env: dict | None = None, timeout: float = 300.0,
                 check: bool = True, preload: tuple[str, ...] = ()) -> list[int]:
    """`script ARGV` on `nproc` forked ranks joined as torchrun --standalone joins them (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, ...): each rank's exit code (a rank past `timeout` is killed).
    check: any code but 0 raises subprocess.CalledProcessError, as torchrun's failure does.
    preload: more modules the server imports for every rank, given at the first call."""
    import socket
    from multiprocessing.connection import wait as mp_wait

    ctx = _fork_context(preload)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
              "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": f"smoke-{port}", **(env or {})}
    procs = [ctx.Process(target=_rank_main, args=(script, argv, {**common, "RANK": str(r), "LOCAL_RANK": str(r),
                                                                 "ROLE_RANK": str(r)}))
             for r in range(nproc)]
    for p in procs:
        p.start()
    # As torchrun's agent does: once a rank fails, stop the others (they would wait in a collective
    # for its gloo timeout), and stop every rank at the deadline.
    deadline = time.monotonic() + timeout
    running = list(procs)
    while running and time.monotonic() < deadline:
        mp_wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
        running = [p for p in running if p.exitcode is None]
        if any(p.exitcode for p in procs if p.exitcode is not None):
            break
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if check and any(codes):     # the code of a rank that failed itself, before one this stopped
        failed = [c for c in codes if c]
        raise subprocess.CalledProcessError(next((c for c in failed if c > 0), failed[0]), [sys.executable, script, *argv])
    return codes


def interleaved(names, rounds: int, *, own_cache: bool = False):
    """(round, name) over `rounds` rounds of `names`, every other one reversed (on a shared host a
    config run last in every round ran ~2% slower). own_cache: HETRAIN_CACHE a profile cache of
    this run alone (one left by another commit or a busy host would set every hetrain run's split;
    within the run the first hetrain config measures and the rest reuse it, as a restarted job would)."""
    with (tempfile.TemporaryDirectory(prefix="hetrain-bench-cache-", ignore_cleanup_errors=True) if own_cache
          else contextlib.nullcontext()) as cache:
        if cache:
            os.environ["HETRAIN_CACHE"] = cache
        for r in range(rounds):
            yield from ((r, name) for name in (names if r % 2 == 0 else names[::-1]))


def launched(names, rounds: int, launch, *, smoke: bool, own_cache: bool = False):
    """(round, name, launch(round, name)) for each of interleaved(names, rounds, own_cache=own_cache), in
    that order. Under --smoke two launches run at a time: a smoke's figures are not judged, and its
    jobs spend much of their time waiting (rendezvous, an emulated device's sleep), which a second
    job fills; each still runs its own code path. Two, not all: each job is several processes that
    import torch, and a CI host has two cores and little memory to spare."""
    from concurrent.futures import ThreadPoolExecutor

    if not smoke:
        for r, name in interleaved(names, rounds, own_cache=own_cache):    # lazily: its cache lives till the end
            yield r, name, launch(r, name)
        return
    with contextlib.ExitStack() as stack:
        if own_cache:      # the cache interleaved() would make, held for the concurrent launches
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="hetrain-bench-cache-",
                                                                    ignore_cleanup_errors=True))
            os.environ["HETRAIN_CACHE"] = cache
        order = list(interleaved(names, rounds))
        pool = stack.enter_context(ThreadPoolExecutor(2))
        futures = [pool.submit(launch, r, name) for r, name in order]
        for (r, name), f in zip(order, futures):
            yield r, name, f.result()


def train_steps(ht, batches) -> tuple[list[float], object]:
    """Every step of `batches` through hetrain's loop: (the clock before the first step and at
    each step's end, the last step's loss)."""
    marks, loss = [time.perf_counter()], None
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
        marks.append(time.perf_counter())
        loss = step.loss
    return marks, loss


def dilate(spec: str, factor: float) -> str:
    """'a100-80g:1.0,t4:0.35@24MiB' with every speed divided by `factor`."""
    out = []
    for item in spec.split(","):
        name, rest = item.split(":", 1)
        speed, _, mem = rest.partition("@")
        out.append(f"{name}:{float(speed) / factor:.4g}" + (f"@{mem}" if mem else ""))
    return ",".join(out)


# -- the demo GPT, as the benchmarks train it ------------------------------------------------
def model_and_data(*, seq_len: int, d_model: int, layers: int):
    """The demo GPT (hetrain.demo.gpt) and the pydoc text windows it trains on."""
    import torch

    from hetrain.demo.gpt import GPT, GPTConfig
    from hetrain.demo.text import ByteWindows, pydoc_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=seq_len, d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 32)))
    return model, ByteWindows(pydoc_bytes(), seq_len)


def hf_gpt2(**config):
    """A Hugging Face GPT-2 built from a config (no downloads), dropout off, byte tokens 0 at both ends."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                      **config))


def loss_of(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def card_policy(precision: str, spec: str, rank: int = 0):
    """hetrain's precision policy for rank `rank`'s card of `spec` on this CPU: the card's precision
    (or the one asked for), computed in fp32 where this CPU runs it slowly."""
    import torch

    from hetrain.hardware.cluster import parse_cluster
    from hetrain.hardware.host import host_facts
    from hetrain.emulation.device import EmulatedDevice
    from hetrain.runtime.devices.precision_policy import PrecisionPolicy

    return PrecisionPolicy.local(precision, device=torch.device("cpu"), host=host_facts(),
                                 given=EmulatedDevice(parse_cluster(spec)[rank]))


def card_autocast(precision: str, spec: str, rank: int = 0):
    """What a careful user runs on rank `rank`'s card of `spec`: autocast by card_policy."""
    import torch

    policy = card_policy(precision, spec, rank)
    if policy.error is not None:
        raise policy.error
    dtype = policy.dtype
    return (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else contextlib.nullcontext


# -- the clock ------------------------------------------------------------------------------
def add_clock_arguments(p: argparse.ArgumentParser, *, default: str = "auto", micro: bool = False) -> None:
    """--clock (and, with `micro`, --clock-micro: the clock's fixed part; without, there is none)."""
    p.add_argument("--clock", default=default,
                   help=f"{default} (default). auto: a controlled clock, a micro-batch of m samples lasting "
                        "(a + m x T) / speed, T calibrated here; a number: T in ms; wall: the CPU's time / speed; "
                        "auto,wall: both, interleaved (benchmarks/_common.py says why)")
    p.add_argument("--clock-ms", type=float, default=None, help=argparse.SUPPRESS)   # the workers' T
    if micro:
        p.add_argument("--clock-micro", type=float, default=MICRO_SAMPLES,
                       help=f"the clock's fixed part a of a micro-batch, in samples' worth of T (default "
                            f"{MICRO_SAMPLES:g}; the planner is not told it); 0: none")


def resolve_clocks(args, p: argparse.ArgumentParser, *, micro_batch: int) -> list[argparse.Namespace]:
    """Each clock --clock names (comma-separated, e.g. auto,wall), resolved as resolve_clock does
    (auto calibrated once): a namespace each with clock, clock_ms, clock_micro_ms."""
    out, calibrated = [], None
    for name in [c.strip() for c in str(args.clock).split(",") if c.strip()]:
        one = argparse.Namespace(**{**vars(args), "clock": name})
        if name == "auto" and calibrated is not None:
            one.clock_ms, one.clock_micro_ms = calibrated
        else:
            resolve_clock(one, p, micro_batch=micro_batch)
            if name == "auto":
                calibrated = (one.clock_ms, one.clock_micro_ms)
        out.append(one)
    if not out:
        p.error("--clock: give auto, wall, a number of ms, or a comma-separated list of them")
    return out


def resolve_clock(args, p: argparse.ArgumentParser, *, micro_batch: int) -> None:
    """Set args.clock_ms from --clock (None: the wall clock); `auto` calibrates on the model
    args.seq_len, args.d_model, args.layers at the fast device's `micro_batch`. Bad values: one
    line, exit 2."""
    args.clock_micro_ms = None
    if getattr(args, "clock_micro", 0.0) < 0:
        p.error(f"--clock-micro {args.clock_micro}: give the fixed part in samples' worth of T, >= 0")
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
    if args.clock_ms:
        args.clock_micro_ms = getattr(args, "clock_micro", 0.0) * args.clock_ms or None


def clock_s(args) -> float | None:      # seconds a sample at speed 1 (None: the wall clock)
    return args.clock_ms / 1000 if getattr(args, "clock_ms", None) else None


def clock_micro_s(args) -> float | None:
    """The clock's fixed seconds a micro-batch at speed 1 (None: none, or the wall clock)."""
    return args.clock_micro_ms / 1000 if clock_s(args) and getattr(args, "clock_micro_ms", None) else None


def clock_config(args) -> dict:        # as fields of hetrain.emulation.Emulation (empty: the wall clock)
    if not clock_s(args):
        return {}
    micro = clock_micro_s(args)
    return {"sample_s": clock_s(args), **({"micro_s": micro} if micro else {})}


def describe_clock(args) -> str:
    if not getattr(args, "clock_ms", None):
        return "wall: each device's CPU time / its speed"
    micro = getattr(args, "clock_micro_ms", None)
    return (f"controlled: {micro:g} ms a micro-batch + {args.clock_ms:g} ms a sample at speed 1" if micro
            else f"controlled: {args.clock_ms:g} ms a sample at speed 1")


def calibrate_clock_ms(*, precision: str, micro_batch: int, seq_len: int = 64, d_model: int = 128,
                       layers: int = 4) -> tuple[float, float]:
    """(the clock's ms a sample at speed 1, the CPU ms a sample it comes from): the fast device's
    forward + backward CPU ms a sample here, one thread, at `micro_batch` in the precision it
    computes in, ×3 rounded up to 0.5 ms."""
    model, data = model_and_data(seq_len=seq_len, d_model=d_model, layers=layers)
    cpu_ms = cpu_ms_per_sample(model, data, max(1, micro_batch), loss_of, autocast=card_autocast(precision, FAST))
    return math.ceil(3 * cpu_ms * 2) / 2, cpu_ms


def cpu_ms_per_sample(model, data, n: int, loss_of, *, autocast=contextlib.nullcontext, steps: int = 8,
                      skip: int = 3) -> float:
    """The model's forward + backward CPU ms a sample on one thread, at a batch of `n` of `data`
    (median of `steps` timed steps after `skip` untimed ones, AdamW stepping between them)."""
    import torch

    torch.set_num_threads(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(n))))
    per_sample = []
    for step in range(skip + steps):
        t = time.thread_time()
        with autocast():
            loss = loss_of(model, x, y)
        loss.backward()
        if step >= skip:
            per_sample.append((time.thread_time() - t) / n)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return statistics.median(per_sample) * 1e3
