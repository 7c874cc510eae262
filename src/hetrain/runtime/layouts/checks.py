"""What a layout object needs of the job, checked when prepare() sees it (one line: reason,
fix), and the model-state factor a pipeline's stages are sized with. A leaf of runtime/layouts:
it imports no other layout module, so every layout class can check without importing choose
(which imports them for 'auto')."""

from __future__ import annotations

from ...errors import UsageError
from ...layout_spec import Pipeline, TensorParallel
from ...planning.memory import state_bytes


def check_request(spec, *, world_size: int) -> None:
    """What DataParallel and TensorParallel need of the job (a Pipeline's needs: check_pipeline)."""
    if isinstance(spec, TensorParallel) and world_size < 2:
        raise UsageError(f"parallel={spec!r} on one device: there is nothing to split the model over",
                         "launch on 2+ devices (`hetrain run` starts one process per GPU, or per device of the cluster it "
                         "is given), or use parallel='dp'")


def state_factor(modules, optimizer_kind: str) -> float:
    """Model-state bytes per parameter byte of these modules' parameters (memory.state_bytes,
    frozen parameters as weights only)."""
    params = [p for m in modules if m is not None for p in m.parameters()]
    n = sum(p.numel() for p in params)
    train = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    pbytes = train[0].element_size() if train else (params[0].element_size() if params else 4)
    fine = dict(trainable=sum(p.numel() for p in train),
                frozen_param_bytes=frozen[0].element_size() if frozen else None)
    weights = sum(p.numel() * p.element_size() for p in params)
    if not weights:
        return 1.0
    return state_bytes(n, optimizer=optimizer_kind, param_bytes=pbytes, **fine).total / weights


def check_pipeline(spec: Pipeline, *, loss_fn, world_size: int) -> None:
    """What a Pipeline needs of the job, checked when prepare() sees it (one line: reason, fix)."""
    shown = f"parallel={spec!r}"
    if loss_fn is None:
        raise UsageError(f"{shown} needs the loss function: the pipeline's schedule computes the loss on the last "
                         "stage", "pass loss_fn=(output, targets) -> mean loss to ht.prepare()")
    if world_size < 2:
        raise UsageError(f"{shown} on one device: there is nothing to split the model over",
                         "launch on 2+ devices (`hetrain run` starts one process per GPU, or per device of the cluster it "
                         "is given), or use parallel=hetrain.DataParallel()")
    stages = spec.stages
    if stages == "auto" and (world_size < 4 or world_size % 2):
        raise UsageError(f"{shown} needs replicas of 2+ stages: {world_size} devices do not make 2+ of them",
                         "use 4, 6, 8... devices, or parallel=hetrain.Pipeline() (one pipeline)")
    divisors = ", ".join(str(k) for k in range(2, world_size + 1) if world_size % k == 0)
    if isinstance(stages, int) and stages > world_size:
        raise UsageError(f"{shown}: {stages} stages need {stages} devices, this job has {world_size}",
                         f"use a stage count that divides {world_size}: {divisors}")
    if isinstance(stages, int) and world_size % stages:
        raise UsageError(f"{shown}: {world_size} devices do not form pipelines of {stages} stages",
                         f"use a stage count that divides {world_size}: {divisors}")
