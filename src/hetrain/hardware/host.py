"""This host's CPU as a compute device: which low-precision dtypes it has in hardware, and how
much slower than fp32 it actually computes each (measured once per host, then cached).

Why it matters: a device that stands for a GPU but computes on this CPU (a cluster spec's device
run by `hetrain run`) keeps the card's relative speed only when the CPU computes the card's
precision about as fast as fp32. CPUs differ: with avx512_bf16 or AMX, bf16 autocast is as fast as
fp32 or faster; with only AVX2 (or AVX512 without its bf16 extension) torch converts every bf16
value in software, and bf16 and fp16 run 4-70x slower than fp32. The precision rule
(planning/precision.py) reads these facts.

The measurement: one thread, a matmul and one transformer block forward+backward, in fp32, bf16
and fp16 (autocast for the block, as training runs it); the least of a few runs of each, the
precisions timed in turn (least_ms_interleaved), so a busy host skews it little, and all alike.
The block's ratio is the one decisions use: it is the work training does.

Sources, in order: $HETRAIN_HOST_FACTS (a recorded file: tests, and forcing another host's path),
the cache ($HETRAIN_CACHE/host, keyed by CPU model, flags and torch version), a new measurement.
A cache file that is unreadable or from another CPU is measured again, with a note saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field

from ..errors import UsageError
from ..vocabulary import PRECISIONS
from ..files import cache_dir, write_json_atomic

HOST_FACTS_ENV = "HETRAIN_HOST_FACTS"
SCHEMA = 1
MATMUL = (512, 256, 512)   # the measured matmul: (M×K) @ (K×N), 2·M·K·N FLOPs (the peak of devices on this CPU)
SLOW = 1.5          # a dtype this many times slower than fp32 breaks a catalog speed computed on this CPU
# The flags that decide low-precision speed: x86 (AVX512-BF16, AMX, AVX512-FP16) and ARM (bf16, fp16 SIMD).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16", "amx_fp16",
         "asimd", "asimdhp", "fphp", "bf16", "sve", "i8mm")
NATIVE = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    cpu: str                                  # model name
    flags: tuple[str, ...]                    # the relevant ones this CPU has (FLAGS)
    torch: str                                # torch version the speeds were measured with
    capability: str = ""                      # torch's CPU kernel level (AVX2, AVX512, ...)
    block_ms: dict = field(default_factory=dict)    # precision -> ms, one block forward+backward
    matmul_ms: dict = field(default_factory=dict)   # precision -> ms, one matmul
    source: str = "measured"                  # measured | cache FILE | recorded FILE
    note: str = ""                            # why it was measured again, when it was

    # -- what the rule needs --------------------------------------------------------------------
    def native(self, precision: str) -> bool:
        """Whether the CPU has this dtype in hardware (fp32 always)."""
        return precision == "fp32" or any(f in self.flags for f in NATIVE.get(precision, ()))

    def slowdown(self, precision: str) -> float:
        """Measured seconds in `precision` / seconds in fp32, for a transformer block (1.0: as fast)."""
        if precision == "fp32" or not self.block_ms.get("fp32"):
            return 1.0
        return self.block_ms.get(precision, self.block_ms["fp32"]) / self.block_ms["fp32"]

    def matmul_flops(self, precision: str) -> float | None:
        """One thread's measured matmul FLOP/s in `precision` (None: not measured)."""
        ms = self.matmul_ms.get(precision)
        m, k, n = MATMUL
        return 2 * m * k * n / (ms / 1e3) if ms else None

    def keeps_speed(self, precision: str) -> bool:
        """Whether a device computing `precision` on this CPU still runs at its catalog speed."""
        return self.slowdown(precision) <= SLOW

    # -- for people ---------------------------------------------------------------------------
    def describe(self) -> str:
        """'Intel Xeon (AVX512; bf16: no avx512_bf16/amx_bf16, 4.4x slower than fp32; fp16: ... )'."""
        parts = []
        for p in ("bf16", "fp16"):
            hw = "in hardware" if self.native(p) else "no " + "/".join(NATIVE[p][:2])
            parts.append(f"{p}: {hw}, {_times(self.slowdown(p))} fp32")
        kernels = f"{self.capability} kernels; " if self.capability else ""
        return f"{self.cpu} ({kernels}{'; '.join(parts)})"

    def precision_meaning(self) -> str:
        """What the precision rule does with devices that compute on this CPU (keeps_speed)."""
        slow = [p for p in ("bf16", "fp16") if not self.keeps_speed(p)]
        if not slow:
            return ("devices computing on this CPU compute in their card's precision (bf16/fp16 run about "
                    "as fast as fp32 here), so their speeds stay true")
        return (f"under precision='auto', devices computing on this CPU whose card runs {' or '.join(slow)} "
                f"compute in fp32 here, so their speeds stay true (--precision {slow[0]} forces it, at the "
                "measured slowdown)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flags"] = list(self.flags)
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: dict) -> HostFacts:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(f"not host facts of schema {SCHEMA}")
        block, matmul = d.get("block_ms", {}), d.get("matmul_ms", {})
        for table in (block, matmul):
            if not isinstance(table, dict) or not all(
                    k in PRECISIONS and isinstance(v, (int, float)) and v > 0 for k, v in table.items()):
                raise ValueError("speeds must map fp32/bf16/fp16 to positive milliseconds")
        if "fp32" not in block:
            raise ValueError("no fp32 speed to compare with")
        return cls(cpu=str(d["cpu"]), flags=tuple(str(f) for f in d["flags"]), torch=str(d["torch"]),
                   capability=str(d.get("capability", "")), block_ms=dict(block), matmul_ms=dict(matmul),
                   source=str(d.get("source", "recorded")), note=str(d.get("note", "")))


def _times(ratio: float) -> str:
    if ratio >= 1.15:
        return f"{ratio:.1f}x slower than" if ratio < 10 else f"{ratio:.0f}x slower than"
    if ratio <= 1 / 1.15:
        return f"{1 / ratio:.1f}x faster than"
    return "about as fast as"


# -- what this CPU is (no torch needed) -------------------------------------------------------
def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; the machine's count where the OS
    has no affinity call): what devices that are threads of this host share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_identity() -> tuple[str, tuple[str, ...]]:
    """(model name, the relevant flags), from /proc/cpuinfo (Linux, x86 and ARM)."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and not name:
                    name = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return (name or platform.processor() or platform.machine() or "unknown CPU",
            tuple(f for f in FLAGS if f in flags))


def _key(cpu: str, flags: tuple[str, ...], torch_version: str) -> dict:
    return {"cpu": cpu, "flags": list(flags), "torch": torch_version}


# -- the measurement --------------------------------------------------------------------------
def measure() -> HostFacts:
    """Time fp32, bf16 and fp16 on one thread (a second or two; fp16 without AVX512-FP16 is slow)."""
    import torch

    cpu, flags = cpu_identity()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        m, k, n = MATMUL
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        block = torch.nn.TransformerEncoderLayer(128, 4, dim_feedforward=512, dropout=0.0, batch_first=True)
        x = torch.randn(8, 64, 128, generator=g)
        matmuls, steps = {}, {}
        for p in PRECISIONS:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[p]
            ap, bp = a.to(dtype), b.to(dtype)
            matmuls[p] = lambda ap=ap, bp=bp: ap @ bp

            def step(dtype=dtype, low=p != "fp32"):
                with torch.autocast("cpu", dtype=dtype, enabled=low):
                    out = block(x)
                out.float().sum().backward()
                block.zero_grad(set_to_none=True)

            steps[p] = step
        matmul_ms, block_ms = least_ms_interleaved(matmuls), least_ms_interleaved(steps)
    finally:
        torch.set_num_threads(threads)
    return HostFacts(cpu=cpu, flags=flags, torch=torch.__version__, capability=_capability(),
                     block_ms=block_ms, matmul_ms=matmul_ms, source="measured")


def least_ms_interleaved(fns: dict, *, budget_s: float = 0.15, runs: int = 5, clock=time.perf_counter) -> dict:
    """Each function's least milliseconds, after a warm-up call of each (kernels chosen, memory
    allocated): at least 2 runs each and at most `runs`, until its runs add up to `budget_s`. The
    functions are timed in turn, one run of each per pass, so a burst of other work on the host
    slows every precision alike instead of all the runs of one. Timed one precision after another,
    a burst as long as one precision's few runs (a fraction of a second) made that precision read
    slow, and past 1.5x the precision rule computes in fp32 (planning/precision.py): once here, on a
    host where bf16 is as fast as fp32, a benchmark's `hetrain plan` chose fp32 for bf16 cards."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    spent = dict.fromkeys(fns, 0.0)
    done = dict.fromkeys(fns, 0)
    while True:
        due = [k for k in fns if done[k] < 2 or (done[k] < runs and spent[k] < budget_s)]
        if not due:
            return {k: v * 1e3 for k, v in best.items()}
        for k in due:
            t0 = clock()
            fns[k]()
            dt = clock() - t0
            best[k], spent[k], done[k] = min(best[k], dt), spent[k] + dt, done[k] + 1


def _capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:   # noqa: BLE001 — an older torch: the kernel level is only informative
        return ""


# -- where the facts come from ----------------------------------------------------------------
def _cache_file(cpu: str, flags: tuple[str, ...], torch_version: str):
    root = cache_dir("host")
    if root is None:
        return None
    slug = hashlib.sha256(json.dumps(_key(cpu, flags, torch_version)).encode()).hexdigest()[:16]
    return root / f"{slug}.json"


def recorded(path: str) -> HostFacts:
    try:
        with open(path) as f:
            facts = HostFacts.from_dict(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"{HOST_FACTS_ENV}={path}: not a host-facts file ({type(e).__name__}: {e})",
                         f"unset {HOST_FACTS_ENV}, or point it at a file `hetrain env --json` wrote") from None
    return HostFacts(**{**asdict(facts), "source": f"recorded {path}"})


def host_facts(*, use_cache: bool = True) -> HostFacts:
    """This host's facts: recorded ($HETRAIN_HOST_FACTS), cached, or measured now (and cached)."""
    path = os.environ.get(HOST_FACTS_ENV)
    if path:
        return recorded(path)
    import torch

    cpu, flags = cpu_identity()
    cached = _cache_file(cpu, flags, torch.__version__) if use_cache else None
    note = ""
    if cached is not None and cached.is_file():
        try:
            facts = HostFacts.from_dict(json.loads(cached.read_text()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            note = f"the cached host facts {cached} were unreadable ({type(e).__name__}): measured again"
        else:
            if (facts.cpu, tuple(facts.flags), facts.torch) == (cpu, flags, torch.__version__):
                return HostFacts(**{**asdict(facts), "source": f"cache {cached}", "note": ""})
            note = (f"the cached host facts {cached} are from another CPU or torch "
                    f"({facts.cpu}, torch {facts.torch}): measured again")
    facts = measure()
    facts = HostFacts(**{**asdict(facts), "note": note})
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(cached, {**facts.to_dict(), "source": "measured", "note": ""})
        except OSError:
            pass      # a read-only home is no reason to fail a run: measured again next time
    return facts
