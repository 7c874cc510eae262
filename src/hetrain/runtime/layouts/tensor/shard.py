"""Tensor parallelism with DTensor: a transformer's attention and MLP split across a device mesh.

    mesh = init_device_mesh("cuda", (world,))           # or tensor_parallel(model) for all ranks
    model = tensor_parallel(model, mesh)                # the styles tp_plan(model, mesh.size()) finds
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())   # the same x, y on every rank
    loss.backward(); opt.step()

The Megatron layout, written as torch's parallel styles (layouts/tensor/styles.py states the rule
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

Hugging Face models (transformers' PreTrainedModel) are split by the plan the model declares
(config.base_model_tp_plan: Llama, Mistral, ...; GPT-2 after its Conv1Ds become Linears):
layouts/tensor/hf.py.

The even split runs each rank at the slowest one's pace on mixed devices. `speeds=` (one relative
speed per rank) splits every layer in proportion instead: whole key/value groups of heads and whole
MLP columns per rank, on plain tensors and two autograd all-reduces (layouts/tensor/uneven.py says
how and why DTensor cannot hold such shards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from ....errors import UsageError
from .hf import gpt2_to_linears, hf_splits, is_hf
from .styles import (
    Split,
    check_size,
    find_splits,
    localize_heads,
    styles,
    tp_plan,
)
from .uneven import (
    ShardedLinear,
    check_speeds,
    localize_uneven,
    shard_uneven,
    speed_split,
    units,
)

__all__ = ["compute_share", "full_grad", "gpt_block_plan", "shard", "tensor_parallel", "tp_plan"]


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


@dataclass
class Sharded:
    """What `shard` did: the model (sharded in place), the parameters a transformation renamed
    ({old name: new names}: GPT-2's c_attn), each split's units per rank, and whether they were cut
    by speed (plain-tensor shards, uneven.py) rather than evenly (DTensor)."""

    model: nn.Module
    splits: list[Split] = field(default_factory=list)
    renamed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    counts: list[tuple[int, ...]] | None = None
    by_speed: bool = False

    def describe(self) -> str:
        """'heads 5/3, MLP columns 40/24' (each distinct split once), for people; under grouped-query
        attention 'key/value heads 3/1 (query heads 6/2)'."""
        seen: list[str] = []
        for s, per_rank in zip(self.splits, self.counts or ()):
            what, n = units(s)
            text = "/".join(map(str, per_rank))
            if s.kind == "attention":
                heads = dict(s.counts)["attention heads"]
                text = (f"heads {text}" if heads == n else
                        f"key/value heads {text} (query heads {'/'.join(str(c * heads // n) for c in per_rank)})")
            else:
                text = f"{what} {text}"
            if text not in seen:
                seen.append(text)
        return ", ".join(seen)


def find_model_splits(model: nn.Module) -> tuple[list[Split], dict[str, tuple[str, ...]]]:
    """The Megatron pairs of `model`: a transformers model's declared plan (GPT-2 transformed
    first, in place), else the structure rule (styles.find_splits)."""
    if is_hf(model):
        renamed = gpt2_to_linears(model) if getattr(model.config, "model_type", None) == "gpt2" else {}
        return hf_splits(model), renamed
    return find_splits(model), {}


def check_even(splits: list[Split], size: int) -> None:
    """check_size's UsageError, with the split by speed named where it would give every rank whole
    heads and columns (it needs no count to divide: 3 heads over 2 ranks are 2/1)."""
    try:
        check_size(splits, size)
    except UsageError as e:
        if not all(units(s)[1] >= size for s in splits):
            raise
        raise UsageError(e.what, f"{e.fix}; or split unevenly, in whole heads and columns: "
                         "parallel=hetrain.TensorParallel(split='speed') (tensor_parallel(model, speeds=[...]))") from None


def shard(model: nn.Module, mesh: DeviceMesh | None = None, *, plan: dict | None = None,
          speeds=None) -> Sharded:
    """tensor_parallel's work, with what it did (Sharded): what the runtime needs to rebuild the
    optimizer and say how the layers were split."""
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
    if plan is not None and speeds is not None:
        raise UsageError("tensor_parallel(plan=, speeds=): a split by speed cuts the heads and MLP columns "
                         "tp_plan finds, and a plan= of DTensor styles splits evenly",
                         "drop speeds= to use your plan, or drop plan= to split by speed")
    size = mesh.size() if mesh is not None else dist.get_world_size()
    done = Sharded(model)
    if plan is None:
        # found and checked before the mesh is made (its first collective): a model that cannot be
        # split raises the same UsageError on every rank, none waiting for another
        done.splits, done.renamed = find_model_splits(model)
        if speeds is None:
            check_even(done.splits, size)
            plan = styles(done.splits)
        else:
            done.counts = speed_split(done.splits, check_speeds(speeds, size))
            done.by_speed = True
    if done.by_speed:
        group = mesh.get_group() if mesh is not None else None
        rank = mesh.get_local_rank() if mesh is not None else dist.get_rank()
        shard_uneven(model, done.splits, done.counts, rank, group)
        localize_uneven(model, done.splits, done.counts, rank)
        return done
    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (size,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, plan)
    if done.splits:
        localize_heads(model, done.splits, size)
        done.counts = [(units(s)[1] // size,) * size for s in done.splits]
    return done


def tensor_parallel(model: nn.Module, mesh: DeviceMesh | None = None, *, plan: dict | None = None,
                    speeds=None) -> nn.Module:
    """Shard `model` in place over the 1-D `mesh` (default: every rank of the job, on this
    process's device type) and return it. `plan`: parallel styles by submodule name, for a model
    whose layout `tp_plan` cannot find (it is then used as given). `speeds`: one relative speed
    per rank, to split every layer in proportion (layouts/tensor/uneven.py); None: evenly."""
    return shard(model, mesh, plan=plan, speeds=speeds).model


def compute_share(model: nn.Module) -> float:
    """This rank's share of the model's matrix multiplies: the elements of its Linears' weights it
    holds over the whole model's (a replicated Linear, like the head, counts whole on every rank).
    Per token, a Linear costs 6 FLOPs per weight element in forward and backward, so this is the
    rank's share of those FLOPs; a device on a controlled clock times a TP rank by it."""
    held = whole = 0
    for m in model.modules():
        if not isinstance(m, nn.Linear):
            continue
        w = m.weight
        if isinstance(m, ShardedLinear):
            local = w.numel()
            full = local // max(m.stop - m.start, 1) * m.full
        else:
            local = w.to_local().numel() if hasattr(w, "to_local") else w.numel()
            full = w.numel()
        held, whole = held + local, whole + full
    return held / whole if whole else 1.0


def full_grad(p: nn.Parameter) -> torch.Tensor:
    """A parameter's whole gradient (gathered from its shards when it is a DTensor)."""
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def rebuild(optimizer, mapping: dict):
    """The same optimizer class, hyperparameters and param groups over the sharded parameters;
    `mapping`: each old parameter's new ones (GPT-2's fused c_attn became three)."""
    from ...sharding.capacity import constructor_defaults

    if optimizer.state:
        raise UsageError("tensor parallelism needs a fresh optimizer, but this one has state already",
                         "pass the optimizer to prepare() before any optimizer step")
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [q for p in g["params"] for q in mapping.get(p, ())]} for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **constructor_defaults(optimizer))
    except (TypeError, ValueError) as e:
        raise UsageError(f"cannot rebuild {type(optimizer).__name__} over the tensor-parallel shards: {e}",
                         "use a torch.optim optimizer") from None
