"""Which autocast precision a device runs, and why (pure: no torch).

The rule (`precision='auto'`):
  * a GPU with bf16 in hardware (compute capability >= 8.0: A100, H100, RTX 30xx/40xx, L4...)
    runs bf16 autocast: fp32's exponent range, so no loss scaling;
  * an older GPU (V100 7.0, T4 7.5) runs fp16 autocast with loss scaling: torch accepts bf16
    there but emulates it slowly (`is_bf16_supported()` says True by default, pytorch PR#148322),
    and cuDNN has no bf16 convolutions below 8.0;
  * an emulated device takes the precision of the catalog GPU it stands for (autocast bf16 and
    fp16 both run for real on the CPU);
  * a plain CPU (no GPU, no emulation) stays fp32: such runs check correctness against fp32
    references, and fp16 autocast on a CPU is ~30x slower. bf16 autocast is real on CPUs with
    AVX512-BF16/AMX; ask for it with precision='bf16'.

A job mixing bf16 and fp16 devices keeps ONE loss scale for the whole job (runtime/precision.py):
scaling is harmless for bf16 and keeps every rank's gradients on the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

PRECISIONS = ("fp32", "bf16", "fp16")
VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What the precision rule needs to know about one device."""

    label: str                                  # for messages, e.g. 'v100-32g#1 (emulated)'
    kind: str                                   # 'cuda' | 'emulated' | 'cpu'
    capability: tuple[int, int] | None = None   # compute capability (CUDA, or the catalog GPU)

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

    @property
    def needs_loss_scaling(self) -> bool:
        return self.precision == "fp16"


def auto_precision(facts: DeviceFacts) -> PrecisionChoice:
    """The 'auto' rule for one device (see the module docstring)."""
    if facts.kind == "cpu":
        return PrecisionChoice(
            requested="auto", precision="fp32",
            reason="plain CPU: fp32 keeps results equal to an fp32 reference "
                   "(bf16 autocast is real on AVX512-BF16/AMX CPUs: precision='bf16')")
    where = "catalog GPU " if facts.kind == "emulated" else ""
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
        slow = " (slow on a CPU: ~30x fp32)" if facts.kind in ("cpu", "emulated") else ""
        return PrecisionChoice(requested="fp16", precision="fp16",
                               reason=f"fp16 asked for, with the job-wide loss scale{slow}")
    # bf16
    if facts.real_bf16:
        return PrecisionChoice(requested="bf16", precision="bf16", reason="bf16 asked for"
                               + ("" if facts.kind == "cpu" else f" (compute capability {facts.cc})"))
    why = (f"{facts.label}: precision='bf16' but compute capability {facts.cc} has no bf16 hardware "
           "(torch would emulate it slowly; cuDNN has no bf16 convolutions below 8.0)")
    if not allow_fallback:
        raise UsageError(why, "use precision='auto' (bf16 where real, fp16 + loss scaling elsewhere) or "
                              "'fp16', or allow the fallback: allow_fallback=True / "
                              "`hetrain run --allow-fallback`")
    return PrecisionChoice(requested="bf16", precision="fp16",
                           reason=f"bf16 asked for; compute capability {facts.cc} < 8.0 runs fp16 "
                                  "with the job-wide loss scale",
                           fallback=f"{facts.label}: bf16 -> fp16 (fallback allowed; no bf16 hardware "
                                    f"at compute capability {facts.cc})")
