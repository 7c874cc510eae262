"""Which autocast precision a device runs, and why (pure: no torch).

The rule (`precision='auto'`):
  * a GPU with bf16 in hardware (compute capability >= 8.0: A100, H100, RTX 30xx/40xx, L4...)
    runs bf16 autocast: fp32's exponent range, so no loss scaling;
  * an older GPU (V100 7.0, T4 7.5) runs fp16 autocast with loss scaling: torch accepts bf16
    there but runs it in software, slowly (`is_bf16_supported()` says True by default, pytorch PR#148322),
    and cuDNN has no bf16 convolutions below 8.0;
  * a device that stands for a catalog GPU but computes on the host CPU (its bf16 and fp16 are the
    CPU's: `DeviceFacts.host_slowdown`) takes the precision of the card, in the plan; it
    *computes* in that precision only when the CPU runs it about as fast as fp32
    (hardware/host.py measures it). Otherwise it computes in fp32, so that the card's speed
    stays true (a CPU without avx512_bf16/AMX runs bf16 4-40x slower than fp32, which no GPU
    does), and says so. An explicit precision='bf16' or 'fp16' is honoured: it computes in that
    dtype, and the measured slowdown is named in a warning (the profile measures it, so the
    plan predicts it);
  * a plain CPU (no GPU, no cluster spec) stays fp32: such runs check correctness against fp32
    references, and fp16 autocast on a CPU is ~30x slower. bf16 autocast is real on CPUs with
    AVX512-BF16/AMX; ask for it with precision='bf16'.

A job mixing bf16 and fp16 devices keeps ONE loss scale for the whole job (runtime/devices/precision_policy.py):
scaling is harmless for bf16 and keeps every rank's gradients on the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UsageError
from ..vocabulary import PRECISIONS

SLOW_ON_HOST = 1.5     # a dtype this many times slower than fp32 on the host breaks a card's speed there
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What the precision rule needs to know about one device."""

    label: str                                  # for messages, e.g. 'v100-32g#1'
    # 'cuda' (a GPU the driver reports) | 'cpu' (the plain CPU) | any other: a catalog card whose
    # arithmetic is the host CPU's (its capability is the catalog's; its bf16/fp16 are the CPU's)
    kind: str
    capability: tuple[int, int] | None = None   # compute capability (CUDA, or the catalog GPU)
    # a card computing on the host CPU: the CPU's time in bf16/fp16 over fp32 (hardware/host.py), its name
    host_slowdown: tuple[tuple[str, float], ...] = ()
    host: str = "this CPU"

    @property
    def card_on_host(self) -> bool:
        """A catalog card whose arithmetic is the host CPU's (neither a driver's GPU nor the plain CPU)."""
        return self.kind not in ("cuda", "cpu")

    def slowdown(self, precision: str) -> float:
        return dict(self.host_slowdown).get(precision, 1.0)

    @property
    def real_bf16(self) -> bool:
        """bf16 runs in hardware: compute capability >= 8.0 (and any CPU autocast, which is real)."""
        return self.kind == "cpu" or (self.capability is not None and self.capability >= (8, 0))

    @property
    def cc(self) -> str:
        return "?" if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"


@dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
    requested: str            # what the config or plan asked for ('auto', 'bf16', ...)
    precision: str            # what this device runs: fp32 | bf16 | fp16
    reason: str               # why, for people
    fallback: str | None = None   # set when the device could not run what was asked
    compute: str = ""             # the dtype this process computes in ('' = precision); differs
                                  # only on a card computing on a host CPU that runs `precision` slowly
    warning: str | None = None    # a card on the host CPU forced to a dtype the CPU runs slowly

    def __post_init__(self) -> None:
        if not self.compute:
            object.__setattr__(self, "compute", self.precision)

    @property
    def needs_loss_scaling(self) -> bool:
        return self.precision == "fp16"


def _times(x: float) -> str:
    return f"{x:.1f}x" if x < 10 else f"{x:.0f}x"


def _on_host(choice: PrecisionChoice, facts: DeviceFacts, *, forced: bool) -> PrecisionChoice:
    """What a card computing on the host CPU computes in for `choice` (see the module docstring)."""
    p = choice.precision
    slow = facts.slowdown(p)
    if not facts.card_on_host or p == "fp32" or slow <= SLOW_ON_HOST:
        return choice
    if forced:
        return replace(choice, warning=(
            f"{facts.label}: {p} forced; {facts.host} runs {p} {_times(slow)} slower than fp32, so this "
            f"device computes about {_times(slow)} below its catalog speed (measured: the plan predicts it); "
            "--precision auto keeps the cards' speeds true"))
    return replace(choice, compute="fp32", reason=(
        f"{choice.reason}; {p} on the real card; {facts.host} runs {p} {_times(slow)} slower than fp32, "
        f"so the device computes in fp32 (--precision {p} forces {p})"))


def auto_precision(facts: DeviceFacts) -> PrecisionChoice:
    """The 'auto' rule for one device (see the module docstring)."""
    return _on_host(_card_rule(facts), facts, forced=False)


def _card_rule(facts: DeviceFacts) -> PrecisionChoice:
    if facts.kind == "cpu":
        return PrecisionChoice(
            requested="auto", precision="fp32",
            reason="plain CPU: fp32 keeps results equal to an fp32 reference "
                   "(bf16 autocast is real on AVX512-BF16/AMX CPUs: precision='bf16')")
    where = "catalog GPU " if facts.card_on_host else ""
    if facts.real_bf16:
        return PrecisionChoice(
            requested="auto", precision="bf16",
            reason=f"{where}compute capability {facts.cc} >= 8.0: bf16 in hardware, fp32 range")
    return PrecisionChoice(
        requested="auto", precision="fp16",
        reason=f"{where}compute capability {facts.cc} < 8.0: no bf16 hardware; "
               "fp16 with the job-wide loss scale")


def choose_precision(requested: str, facts: DeviceFacts, *, allow_fallback: bool = False) -> PrecisionChoice:
    """The precision `facts`' device runs when `requested` is asked for.

    Raises UsageError for a precision the device cannot run (bf16 on a pre-Ampere GPU) unless
    `allow_fallback`, which runs fp16 instead and says so in `fallback`.
    """
    if requested == "auto":
        return auto_precision(facts)
    if requested not in PRECISIONS:
        raise UsageError(f"precision {requested!r} is not known", f"use 'auto' or one of {PRECISIONS}")
    if requested == "fp32":
        return PrecisionChoice(requested="fp32", precision="fp32", reason="fp32 asked for")
    if requested == "fp16":
        slow = " (slow on a CPU: ~30x fp32)" if facts.kind == "cpu" else ""
        return _on_host(PrecisionChoice(requested="fp16", precision="fp16",
                                        reason=f"fp16 asked for, with the job-wide loss scale{slow}"), facts, forced=True)
    # bf16
    if facts.real_bf16:
        return _on_host(PrecisionChoice(requested="bf16", precision="bf16", reason="bf16 asked for"
                                        + ("" if facts.kind == "cpu" else f" (compute capability {facts.cc})")),
                        facts, forced=True)
    why = (f"{facts.label}: precision='bf16' but compute capability {facts.cc} has no bf16 hardware "
           "(torch would run it in software, slowly; cuDNN has no bf16 convolutions below 8.0)")
    if not allow_fallback:
        raise UsageError(why, "use precision='auto' (bf16 where real, fp16 + loss scaling elsewhere) or "
                              "'fp16', or allow the fallback: allow_fallback=True / "
                              "`hetrain run --allow-fallback`")
    return _on_host(PrecisionChoice(requested="bf16", precision="fp16",
                                    reason=f"bf16 asked for; compute capability {facts.cc} < 8.0 runs fp16 "
                                           "with the job-wide loss scale",
                                    fallback=f"{facts.label}: bf16 -> fp16 (fallback allowed; no bf16 hardware "
                                             f"at compute capability {facts.cc})"), facts, forced=True)
