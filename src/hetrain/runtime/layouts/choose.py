"""Which layout a job runs: prepare(parallel=...) — 'auto', 'dp', 'pp', 'dp-pp', 'tp', or a Plan.

'auto' follows the planner, in this order, and says why:
  1. plain data parallelism when the whole model (parameters, gradients, optimizer state) and one
     sample's activations fit every device;
  2. else data parallelism with sharding, when one of the shardings fits (runtime/sharding/:
     sharding='auto' then picks which);
  3. else the fastest pipeline layout that fits, one pipeline or DP×PP
     (planning/parallelism.compare_parallelism on the measured blocks).
Tensor parallelism is never chosen: it splits every layer evenly, so on mixed devices each rank
waits for the slowest; ask for it (parallel='tp') within a group of equal devices.
Every rank decides from the same exchanged values, so all take the same branch.
"""

from __future__ import annotations

from ...errors import UsageError, did_you_mean
from ...hardware.units import format_bytes
from ...planning.memory import DeviceMemory, sharding_options, state_bytes
from ...planning.plan import Plan
from ...vocabulary import PARALLEL_REQUESTS


_ALIASES = {"pipeline": "pp", "pipe": "pp", "tensor": "tp", "data": "dp", "ddp": "dp",
            "fsdp": "dp (with sharding='fsdp')", "zero": "dp (with sharding='zero1')", "hybrid": "dp-pp", "dp×pp": "dp-pp", "dpxpp": "dp-pp", "dp+pp": "dp-pp", "dppp": "dp-pp"}


def requested(parallel, given_plan: Plan | None) -> str:
    """The layout asked for: a Plan's, or one of PARALLEL_REQUESTS (a one-line error otherwise)."""
    if isinstance(parallel, Plan):
        return parallel.layout
    if not isinstance(parallel, str) or parallel not in PARALLEL_REQUESTS:
        alias = _ALIASES.get(parallel.lower().replace(" ", "")) if isinstance(parallel, str) else None
        hint = (f" (did you mean: {alias}?)" if alias else did_you_mean(parallel, PARALLEL_REQUESTS)) \
            if isinstance(parallel, str) else ""
        raise UsageError(f"prepare(parallel={parallel!r}) is not a layout{hint}",
                         f"use one of {', '.join(PARALLEL_REQUESTS)}, or a Plan from `hetrain plan --out`")
    if parallel == "auto" and given_plan is not None:
        return given_plan.layout
    return parallel


def check_request(kind: str, *, loss_fn, world_size: int) -> None:
    if kind in ("pp", "dp-pp") and loss_fn is None:
        raise UsageError(f"parallel={kind!r} needs the loss function: the pipeline's schedule computes the loss "
                         "on the last stage", "pass loss_fn=(output, targets) -> mean loss to ht.prepare()")
    if kind in ("pp", "dp-pp", "tp") and world_size < 2:
        raise UsageError(f"parallel={kind!r} on one device: there is nothing to split the model over",
                         "launch on 2+ devices (hetrain run --emulate ... or one process per GPU), or use parallel='dp'")
    if kind == "dp-pp" and (world_size < 4 or world_size % 2):
        raise UsageError(f"parallel='dp-pp' needs replicas of 2+ stages: {world_size} devices do not make 2+ of them",
                         "use 4, 6, 8... devices, or parallel='pp'")


def model_state(modules, optimizer_kind: str) -> tuple[float, float, dict]:
    """(state factor, gradient fraction, sharding_options' fine-tuning arguments) of these modules'
    parameters: model-state bytes per parameter byte (memory.state_bytes, frozen parameters as
    weights only) and the trainable fraction of the parameter bytes (what DDP all-reduces)."""
    params = [p for m in modules if m is not None for p in m.parameters()]
    n = sum(p.numel() for p in params)
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    pbytes = train[0].element_size() if train else (params[0].element_size() if params else 4)
    fine = dict(trainable=sum(p.numel() for p in train),
                frozen_param_bytes=frozen[0].element_size() if frozen else None)
    weights = sum(p.numel() * p.element_size() for p in params)
    if not weights:
        return 1.0, 1.0, fine
    total = state_bytes(n, optimizer=optimizer_kind, param_bytes=pbytes, **fine).total
    return total / weights, sum(p.numel() * p.element_size() for p in train) / weights, fine


def state_fits(model, devices, *, factor: float, margin: float) -> tuple[bool, str]:
    """Does the whole model's training state (parameters, gradients, optimizer: `factor` × the
    parameter bytes) leave room on every device? Half the usable memory is kept for activations
    before this says yes without measuring; otherwise the blocks are measured."""
    state = factor * sum(p.numel() * p.element_size() for p in model.parameters())
    capped = [d for d in devices if d.memory_bytes]
    if not capped:
        return True, "no device's memory is capped"
    smallest = min(capped, key=lambda d: d.memory_bytes)
    usable = smallest.memory_bytes * (1 - margin)
    if state <= 0.5 * usable:
        return True, (f"the whole model's training state ({format_bytes(state)}) fits every device "
                      f"(smallest: {smallest.name}, {format_bytes(usable)} usable)")
    return False, ""


def auto(job, *, model, optimizer_kind: str, parts, profile, devices, choice) -> tuple[str, str]:
    """(layout, why) for parallel='auto', from every rank's usable memory and the measured blocks
    (`choice`: compare_parallelism's)."""
    if choice.choice.kind == "dp":
        return "dp", f"the whole model fits every device ({choice.reason})"
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    pbytes = params[0].element_size() if params else 4
    act = profile.activation_bytes_per_sample
    mem = [DeviceMemory(label=d.name, capacity=d.memory_bytes * (1 - job.config.memory.margin), activations=act)
           for d in devices if d.memory_bytes]
    if len(mem) == len(devices):
        options = sharding_options(n, mem, optimizer=optimizer_kind, param_bytes=pbytes,
                                   **model_state([model], optimizer_kind)[2],
                                   unit_params=[sum(p.numel() for p in b.parameters()) for b in parts.blocks],
                                   root_params=n - sum(sum(p.numel() for p in b.parameters()) for b in parts.blocks))
        fitting = [o for o in options if o.strategy != "none" and o.fits(mem)]
        if fitting:
            return "dp", (f"the whole model does not fit every device, sharding={fitting[0].strategy} does "
                          f"(largest per device {format_bytes(max(fitting[0].peak))})")
    pipelines = [c for c in choice.candidates if c.kind != "dp" and c.fits]
    if not pipelines:
        raise UsageError("parallel='auto': no layout fits memory: "
                         + "; ".join(f"{c.name}: {c.detail}" for c in choice.candidates),
                         "try activation checkpointing, smaller micro-batches, or devices with more memory")
    best = max(pipelines, key=lambda c: c.samples_per_s)
    kind = "pp" if best.kind == "pp" else "dp-pp"
    return kind, (f"the model does not fit one device even sharded; {best.name} fits and is the fastest "
                  f"that does ({best.samples_per_s:.1f} samples/s predicted; {best.detail})")
