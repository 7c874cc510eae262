"""Tensor parallelism with DTensor: a transformer's attention and MLP split across a device mesh.

    mesh = init_device_mesh("cuda", (world,))           # or tensor_parallel(model) for all ranks
    model = tensor_parallel(model, mesh)                # the styles tp_plan(model, mesh.size()) finds
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())   # the same x, y on every rank
    loss.backward(); opt.step()

The Megatron layout, written as torch's parallel styles (parallel/tensor_styles.py states the rule
that finds it in a model's blocks: by the common names, else by structure):
  * attention: q, k, v `ColwiseParallel` (each rank computes a contiguous slice of their output
    features = whole heads, which is why a fused qkv projection is refused), the output projection
    `RowwiseParallel` (partial sums all-reduced back to a replicated output);
  * MLP: the up (and gate) projections `ColwiseParallel`, the down projection `RowwiseParallel`.
One all-reduce per attention and one per MLP in the forward (and their mirror in the backward);
embeddings, norms and the (tied) head stay replicated, every rank computing them identically.
Head counts, key/value head counts and MLP widths must divide by the mesh size; an attention
module that keeps its head width (head_dim) has its head-count attributes set to the local count.
A model the rule does not fit takes `plan=`: styles by submodule name, used as given.

Tensor parallelism splits every layer evenly, so each rank waits for the slowest: use it within a
group of equal devices (e.g. the GPUs of one node) and let data or pipeline parallelism take the
heterogeneity.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ...errors import UsageError
from .tensor_styles import check_size, find_splits, localize_heads, styles, tp_plan

__all__ = ["full_grad", "gpt_block_plan", "tensor_parallel", "tp_plan"]


def gpt_block_plan() -> dict:
    """The parallel styles for one demo-GPT block, by submodule name."""
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }


def tensor_parallel(model: nn.Module, mesh: DeviceMesh | None = None, *, plan: dict | None = None) -> nn.Module:
    """Shard `model` in place over the 1-D `mesh` (default: every rank of the job, on this
    process's device type) and return it. `plan`: parallel styles by submodule name, for a model
    whose layout `tp_plan` cannot find (it is then used as given)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError("tensor_parallel needs the job's process group",
                         "call hetrain.init() first, and launch with `hetrain run` (one process per device)")
    if mesh is not None and mesh.ndim != 1:
        raise UsageError(f"tensor_parallel takes a 1-D mesh, got {mesh.ndim}-D",
                         "pass the tensor-parallel dimension of your mesh, e.g. mesh['tp']")
    if plan is not None and not isinstance(plan, dict):
        raise UsageError(f"plan= takes a dict of parallel styles by submodule name, got {type(plan).__name__}",
                         "e.g. plan={'layers.0.attn.q_proj': ColwiseParallel(), ...}")
    size = mesh.size() if mesh is not None else dist.get_world_size()
    splits = None
    if plan is None:
        # found and checked before the mesh is made (its first collective): a model that cannot be
        # split raises the same UsageError on every rank, none waiting for another
        splits = find_splits(model)
        check_size(splits, size)
        plan = styles(splits)
    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (size,), mesh_dim_names=("tp",))
    model = parallelize_module(model, mesh, plan)
    if splits is not None:
        localize_heads(model, splits, size)
    return model


def full_grad(p: nn.Parameter) -> torch.Tensor:
    """A parameter's whole gradient (gathered from its shards when it is a DTensor)."""
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g
