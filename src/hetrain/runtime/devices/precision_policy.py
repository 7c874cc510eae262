"""Per-device precision at run time: autocast dtype, ONE job-wide loss scale, TF32 and cuDNN.

Each rank picks its precision from its own device (planning/precision.py has the rule); the ranks
then agree, in one collective, so that
  * a device that cannot run what was asked stops the job on every rank with the same error
    (not one rank raising while its peers wait in a collective);
  * when any device runs fp16, EVERY rank scales its loss by the same scale: one
    `ShardedGradScaler` per rank, which all-reduces "found inf" across the job before stepping.
    An overflow on any rank (or in any rank's gradient shard, under ZeRO/FSDP) therefore skips
    the step on all ranks, and every rank's scale follows the same trajectory. A step is known to
    be skipped when the scale drops (the scaler's own signal); skipped steps are counted and shown.

bf16 ranks in a mixed job scale too: bf16 has fp32's range, so scaling costs nothing there, and
gradients from every rank then meet the same scale in the all-reduce.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ...errors import UsageError
from ...planning.plan import Plan
from ...planning.precision import DeviceFacts, PrecisionChoice, choose_precision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_facts(device: torch.device, given=None, host=None) -> DeviceFacts:
    """This rank's device, as the precision rule sees it. `given`: the device where a spec gives
    it rather than its hardware (DeviceHooks.given_device); it answers `precision_facts(host)`,
    `host` being the facts of the CPU it computes on (hardware.host.HostFacts: how fast that CPU
    computes bf16 and fp16)."""
    if given is not None:
        return given.precision_facts(host)
    if device.type == "cuda":
        return DeviceFacts(label=f"cuda:{device.index} {torch.cuda.get_device_name(device)}", kind="cuda",
                           capability=tuple(torch.cuda.get_device_capability(device)))
    return DeviceFacts(label=f"cpu ({device})", kind="cpu")


@dataclass
class MathSettings:
    """TF32 and cudnn.benchmark for one CUDA device, with the reason (None off CUDA)."""

    tf32: bool | None = None
    cudnn_benchmark: bool | None = None
    reason: str = ""


def math_settings(facts: DeviceFacts, choice: PrecisionChoice) -> MathSettings:
    if facts.kind != "cuda":
        where = "CPU" if facts.kind == "cpu" else f"{facts.kind} on CPU"    # a device kind that computes on it
        return MathSettings(reason=f"TF32/cudnn.benchmark: not applicable ({where})")
    if facts.capability < (8, 0):
        tf32, why = False, f"TF32 off: compute capability {facts.cc} has no TF32 units"
    elif choice.requested == "fp32":
        tf32, why = False, "TF32 off: precision='fp32' asked for full fp32 matmuls"
    else:
        tf32, why = True, (f"TF32 on: compute capability {facts.cc}; fp32 ops outside autocast use "
                           "TF32 tensor cores (10-bit mantissa, fp32 range)")
    return MathSettings(tf32=tf32, cudnn_benchmark=True,
                        reason=why + "; cudnn.benchmark on: a rank's micro-batches take at most two "
                                     "shapes per plan, so autotuning is paid once per shape")


def apply_math_settings(settings: MathSettings) -> None:
    """Process-wide switches (one process per device, so per device)."""
    if settings.tf32 is None:
        return
    torch.backends.cuda.matmul.allow_tf32 = settings.tf32
    torch.backends.cudnn.allow_tf32 = settings.tf32
    torch.backends.cudnn.benchmark = bool(settings.cudnn_benchmark)


@dataclass
class PrecisionPolicy:
    """This rank's precision and the job's loss scaling. Made by `local()`, completed by `agree()`."""

    facts: DeviceFacts
    choice: PrecisionChoice | None
    error: UsageError | None = None
    math: MathSettings = field(default_factory=MathSettings)
    all_choices: list[dict] = field(default_factory=list)   # every rank's, after agree()
    scaler: torch.amp.GradScaler | None = None
    skipped_steps: list[int] = field(default_factory=list)

    @classmethod
    def local(cls, requested: str, *, device: torch.device, given=None, host=None,
              allow_fallback: bool = False) -> PrecisionPolicy:
        """This rank's choice (`given`, `host`: as device_facts takes them). Errors are
        kept, not raised: `agree` raises them on every rank. 'auto' is decided by the device rule,
        also with a given plan (whose `precision` fields then record what ran): a planner applies
        the same rule (planning/precision.py)."""
        facts = device_facts(device, given, host)
        try:
            choice = choose_precision(requested, facts, allow_fallback=allow_fallback)
        except UsageError as e:
            return cls(facts=facts, choice=None, error=e)
        return cls(facts=facts, choice=choice, math=math_settings(facts, choice))

    # -- agreement (a collective) --------------------------------------------------------------
    def agree(self, *, rank: int, world_size: int, device: torch.device, log=None) -> None:
        mine = {"rank": rank, "device": self.facts.label,
                "precision": self.choice.precision if self.choice else None,
                "compute": self.choice.compute if self.choice else None,
                "warning": self.choice.warning if self.choice else None,
                "reason": self.choice.reason if self.choice else "",
                "fallback": self.choice.fallback if self.choice else None,
                "math": self.math.reason,
                "error": (self.error.what, self.error.fix) if self.error else None}
        everyone = [mine]
        if world_size > 1:
            everyone = [None] * world_size
            dist.all_gather_object(everyone, mine)
        errors = [e for e in everyone if e["error"]]
        if errors:
            what = "; ".join(f"rank {e['rank']}: {e['error'][0]}" for e in errors)
            raise UsageError(what, errors[0]["error"][1])
        self.all_choices = everyone
        apply_math_settings(self.math)
        if any(e["precision"] == "fp16" for e in everyone):
            # One scaler per rank, same settings, found-inf all-reduced across the job in unscale_:
            # every rank takes the same skip/step decision and keeps the same scale.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            class JobScaler(ShardedGradScaler):
                """Its found-inf as torch.amp.GradScaler's, 0-d and 0 or 1: a fused optimizer
                (AdamW(fused=True), the HF Trainer's default adamw_torch_fused) subtracts it from its
                0-d step counts, which ShardedGradScaler's (1,)-shaped one does not broadcast into,
                and the CPU kernel skips the update only on exactly 1 (the all-reduced sum is the
                number of ranks that overflowed: 2 updated the weights with inf gradients)."""

                def unscale_(self, optimizer):
                    super().unscale_(optimizer)         # unscaled; found-inf all-reduced over the job
                    state = self._per_optimizer_states[id(optimizer)]
                    state["found_inf_per_device"] = {d: t.clamp(max=1.0).reshape(())
                                                     for d, t in state["found_inf_per_device"].items()}

            self.scaler = JobScaler(device.type, process_group=dist.group.WORLD)
            # GradScaler makes its scale at its first scale(): make it now, so a rank that never
            # scales a loss (a pipeline's first stages) still unscales its gradients with it.
            self.scaler.scale(torch.zeros((), device=device))
        if log is not None:
            self._show(log)

    def _show(self, log) -> None:
        scaled = self.scaler is not None
        mixed = len({e["precision"] for e in self.all_choices}) > 1
        rows = [(e["rank"], e["device"], e["precision"] + ("" if e["compute"] == e["precision"]
                                                           else f" (computes {e['compute']})"),
                 "job-wide" if scaled else "-", e["reason"]) for e in self.all_choices]
        title = "precision per device"
        if scaled:
            title += (": one loss scale for the whole job (fp16 on "
                      + ", ".join(str(e["rank"]) for e in self.all_choices if e["precision"] == "fp16")
                      + ("; bf16/fp32 ranks scale too" if mixed else "") + ")")
        # the plan's table shows each precision (and what it computes in); this one says why
        log.table(title, ("rank", "device", "precision", "loss scale", "why"), rows, detail=True)
        for e in self.all_choices:   # each rank warns of its own device (runtime/ranks/log.py names the rank)
            if e["rank"] == log.rank and e["fallback"]:
                log.warn(e["fallback"])
            if e["rank"] == log.rank and e["warning"]:
                log.warn(e["warning"])
            log.detail(f"  rank {e['rank']}: {e['math']}")

    # -- facts ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The device's precision, as the plan records it (the card's, where a spec gives the device)."""
        return self.choice.precision if self.choice else "fp32"

    @property
    def compute(self) -> str:
        """The dtype this process computes in: `name`, or fp32 for a device whose host CPU runs
        `name` slowly (planning/precision.py). What autocast and the profiler use."""
        return self.choice.compute if self.choice else "fp32"

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.compute)

    def record_in(self, plan: Plan) -> Plan:
        """The plan with every rank's agreed precision (same plan, same version: a record)."""
        if not self.all_choices or len(self.all_choices) != plan.world_size:
            return plan
        devices = tuple(replace(d, precision=e["precision"]) for d, e in zip(plan.devices, self.all_choices))
        return replace(plan, devices=devices) if devices != plan.devices else plan

    # -- the verbs -----------------------------------------------------------------------------
    def autocast(self, device_type: str):
        dtype = self.dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients and agree, across the job, whether any is inf/NaN."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *, step_index: int, log=None) -> bool:
        """The optimizer step, or the skip every rank agreed on. Returns whether it stepped."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        after = self.scaler.get_scale()
        if after < before:   # the scaler backs off exactly when it skipped
            self.skipped_steps.append(step_index)
            if log is not None:
                log.warn_job(f"step {step_index}: inf/NaN gradients (fp16 overflow) on some rank: step "
                         f"skipped on every rank, loss scale {before:g} -> {after:g}")
            return False
        return True

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler is not None else None

    def show_summary(self, log, *, steps: int) -> None:
        if self.scaler is not None:
            log.info(f"precision: {len(self.skipped_steps)} of {steps} steps skipped for inf/NaN gradients "
                     f"(agreed on every rank){' at ' + str(self.skipped_steps) if self.skipped_steps else ''}; "
                     f"job-wide loss scale now {self.loss_scale:g}")

    def summary(self) -> dict:
        return {"precision": self.name, "compute": self.compute, "loss_scale": self.loss_scale,
                "skipped_steps": len(self.skipped_steps), "skipped_at": list(self.skipped_steps),
                "per_rank": [e["precision"] for e in self.all_choices],
                "per_rank_compute": [e["compute"] for e in self.all_choices]}
