"""Tensor parallelism with DTensor: the demo GPT's attention and MLP split across a device mesh.

    mesh = init_device_mesh("cuda", (world,))           # or tensor_parallel(model) for all ranks
    model = tensor_parallel(model, mesh)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())   # the same x, y on every rank
    loss.backward(); opt.step()

The Megatron layout, written as torch's parallel styles:
  * attention: q, k, v `ColwiseParallel` (each rank computes a contiguous slice of their output
    features = whole heads, since the GPT keeps q, k, v as separate projections and views heads
    with -1), proj `RowwiseParallel` (partial sums all-reduced back to a replicated output);
  * MLP: fc `ColwiseParallel`, proj `RowwiseParallel`.
One all-reduce per attention and one per MLP in the forward (and their mirror in the backward);
embeddings, norms and the tied head stay replicated, every rank computing them identically.

Tensor parallelism splits every layer evenly, so each rank waits for the slowest: use it within a
group of equal devices (e.g. the GPUs of one node) and let data or pipeline parallelism take the
heterogeneity. n_heads and 4·d_model must divide by the mesh size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..errors import UsageError


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


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise UsageError(
            f"cannot find the blocks of a {type(model).__name__} to shard: tensor_parallel looks for "
            "`model.blocks` (an nn.ModuleList of blocks with attn.q/k/v/proj and mlp.fc/proj)",
            "pass plan= with your model's parallel styles by submodule name, e.g. "
            "{'blocks.0.attn.q': ColwiseParallel(), ...}")
    return blocks


def tensor_parallel(model: nn.Module, mesh: DeviceMesh | None = None, *, plan: dict | None = None) -> nn.Module:
    """Shard `model` in place over the 1-D `mesh` (default: every rank of the job, on this
    process's device type) and return it. `plan`: parallel styles by submodule name for models
    other than the demo GPT."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError("tensor_parallel needs the job's process group",
                         "call hetrain.init() first, and launch with `hetrain run` (one process per device)")
    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    if mesh.ndim != 1:
        raise UsageError(f"tensor_parallel takes a 1-D mesh, got {mesh.ndim}-D",
                         "pass the tensor-parallel dimension of your mesh, e.g. mesh['tp']")
    size = mesh.size()
    if plan is not None:
        return parallelize_module(model, mesh, plan)
    for i, block in enumerate(_blocks(model)):
        heads = getattr(getattr(block, "attn", None), "n_heads", None)
        if heads is None:
            raise UsageError(f"block {i} has no attn.n_heads", "pass plan= for a model other than the demo GPT")
        if heads % size:
            raise UsageError(f"{heads} attention heads cannot be split over {size} ranks as whole heads",
                             f"use a tensor-parallel size that divides {heads}, or a model with more heads")
        hidden = block.mlp.fc.out_features
        if hidden % size:
            raise UsageError(f"MLP width {hidden} does not divide over {size} ranks",
                             f"use a tensor-parallel size that divides {hidden}")
        parallelize_module(block, mesh, gpt_block_plan())
    return model


def full_grad(p: nn.Parameter) -> torch.Tensor:
    """A parameter's whole gradient (gathered from its shards when it is a DTensor)."""
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g
