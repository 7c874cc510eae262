"""What a model's blocks are, and what each costs: the input to sizing pipeline stages.

A pipeline cuts a model between its blocks. hetrain finds them in an nn.Sequential (its
children), an nn.ModuleList, the demo GPT (embeddings before the blocks, ln_f + tied head after),
or any model described as `PipelineParts(first=, blocks=, last=)`. It does not trace arbitrary
forwards: torch's tracer (`pipelining.pipeline`) bakes the example's micro-batch shape into the
graph (so micro-batches of another size fail) and copies a tied weight to both stages without
keeping the copies in sync.

`profile_blocks` times each part's forward + backward on a micro-batch and counts the bytes its
forward saves for backward, part by part (a part moves to the device only while it is measured,
so the whole model need not fit one device).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ...devices import clock as clocks
from ....errors import UsageError
from .split import BlockCost, PipelineProfile


# -- what a model's blocks are ----------------------------------------------------------------
@dataclass(frozen=True)
class PipelineParts:
    """A model as `last(blocks[-1](... blocks[0](first(x))))`; pipelines cut between blocks.
    `first` runs on the first stage, `last` on the last; either may be None."""

    blocks: tuple[nn.Module, ...]
    first: nn.Module | None = None
    last: nn.Module | None = None

    def __post_init__(self) -> None:
        if not self.blocks:
            raise UsageError("PipelineParts has no blocks", "give the model's list of blocks")


def repeated_blocks(model: nn.Module) -> tuple[str, tuple[nn.Module, ...]] | None:
    """The model's stack of identical blocks, wherever it is: the nn.ModuleList of two or more
    children of one class with the same parameter shapes that holds the most parameters, as
    (its name, its blocks). This finds nn.TransformerEncoder's `layers`, Hugging Face GPT-2's
    `transformer.h` and Llama/Mistral's `model.layers` without knowing those classes. It counts
    the blocks (for planning); cutting a pipeline needs the parts' composition (find_parts)."""
    best, best_params = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        kinds = {(type(c), tuple((n, tuple(p.shape)) for n, p in c.named_parameters())) for c in m}
        params = sum(p.numel() for p in m.parameters())
        if len(kinds) == 1 and params > best_params:
            best, best_params = (name, tuple(m)), params
    return best


def find_parts(model: nn.Module | PipelineParts) -> PipelineParts:
    """The blocks to cut between, or a UsageError saying how to describe them."""
    if isinstance(model, PipelineParts):
        return model
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return PipelineParts(blocks=tuple(model))
    if isinstance(model, nn.TransformerEncoder):     # its forward: the layers in turn, then the norm
        return PipelineParts(blocks=tuple(model.layers), last=model.norm)
    if hasattr(model, "pipeline_parts"):
        return model.pipeline_parts()
    raise UsageError(
        f"cannot split a {type(model).__name__} into pipeline stages: hetrain finds the blocks of an "
        "nn.Sequential, an nn.ModuleList, an nn.TransformerEncoder or a model with pipeline_parts() "
        "(the demo GPT), and does not trace arbitrary forwards",
        "pass PipelineParts(first=..., blocks=..., last=...) whose composition is the model's forward "
        "(or give the model a pipeline_parts() method returning one); or use data parallelism "
        "(hetrain.init + prepare) with activation checkpointing or sharding if the model fits")


class StageModule(nn.Module):
    """What one stage runs: `first` (stage 0), its slice of blocks, `last` (final stage)."""

    def __init__(self, parts: PipelineParts, start: int, stop: int, *, is_first: bool, is_last: bool):
        super().__init__()
        self.first = parts.first if is_first else None
        self.blocks = nn.ModuleList(parts.blocks[start:stop])
        self.last = parts.last if is_last else None

    def reslice(self, parts: PipelineParts, start: int, stop: int) -> None:
        """Hold blocks [start, stop) from now on (an online re-split: layouts/pipeline/resplit.py). The
        module object stays the same, so what holds it (the prepared model, the checkpoint's
        stage state) sees the new blocks; `first` and `last` stay with their stages."""
        self.blocks = nn.ModuleList(parts.blocks[start:stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first is not None:
            x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.last(x) if self.last is not None else x


# -- how a stage computes (layouts/pipeline/stage.py), and its blocks are measured alike -------
def stage_autocast(precision, device_type: str):
    """The device's autocast (runtime/devices/precision_policy.py: a no-op for fp32), or none without a policy."""
    return precision.autocast(device_type) if precision is not None else contextlib.nullcontext()


def to_fp32(out):
    """Activations cross stages in fp32 (or the model's float64), whatever each stage computes in:
    the receive buffers have one dtype, and a bf16 stage may feed an fp16 one."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
    if isinstance(out, tuple):
        return tuple(to_fp32(o) for o in out)
    return out


# -- measuring the blocks ---------------------------------------------------------------------
class SavedBytes:
    """Bytes of the tensors autograd saves for backward (parameters excluded), deduplicated."""

    def __init__(self, skip: set[int]):
        self.skip, self.seen, self.bytes = skip, set(), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen and ptr not in self.skip:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def param_storage_ptrs(module: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def _unique_param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())   # parameters() dedupes


def profile_blocks(parts: PipelineParts, example: torch.Tensor, *, device: torch.device | None = None,
                   repeats: int = 15, precision=None) -> PipelineProfile:
    """Forward + backward time and saved-activation bytes of each part on `example` (one
    micro-batch), per sample. Times are this thread's CPU time on CPU (throttling excluded) and
    synchronised wall time on CUDA; the least of `repeats` runs (preemption only adds time; 15, as
    5 left block 0's figure 8% above its neighbours' in one plan of a DP×PP benchmark on a shared
    2-core host, and every stage's factor is read against block 0's: runtime/layouts/pipeline/probe.py).
    `precision`: the device's PrecisionPolicy, whose autocast every part runs under, as a stage
    runs it (layouts/pipeline/stage.py): a bf16 stage's blocks cost what bf16 costs there."""
    device = device or example.device
    cuda = device.type == "cuda"
    clock = clocks.host if cuda else clocks.thread_cpu
    samples = example.shape[0]
    named = ([("first", parts.first)] if parts.first is not None else []) + \
        [(f"block {i}", b) for i, b in enumerate(parts.blocks)] + \
        ([("last", parts.last)] if parts.last is not None else [])
    costs, boundary = {}, 0.0
    with torch.random.fork_rng(devices=[device] if cuda else []):
        x = example.to(device)
        for name, part in named:
            home = next(part.parameters(), torch.empty(0)).device
            part.to(device)        # one part at a time: the whole model need not fit this device
            inp = x.detach().requires_grad_(x.is_floating_point())
            counter = SavedBytes(param_storage_ptrs(part))
            with counter.hooks(), stage_autocast(precision, device.type):
                out = part(inp)
            grad = torch.ones_like(out)
            out.backward(grad)
            clocks.synchronize(device)
            seconds = math.inf
            for _ in range(repeats):
                t0 = clock()
                with stage_autocast(precision, device.type):
                    out_again = part(inp)
                out_again.backward(grad)
                clocks.synchronize(device)
                seconds = min(seconds, clock() - t0)
            costs[name] = BlockCost(seconds=seconds / samples, activation_bytes=counter.bytes / samples,
                                    param_bytes=_unique_param_bytes(part), name=name)
            out = to_fp32(out)           # what the next stage receives
            if name.startswith("block") and not boundary:
                boundary = out.numel() * out.element_size() / samples
            x = out.detach()
            part.zero_grad(set_to_none=True)
            part.to(home)
    tied = 0
    if parts.first is not None and parts.last is not None:
        firsts = {id(p) for p in parts.first.parameters()}
        tied = sum(p.numel() * p.element_size() for p in parts.last.parameters() if id(p) in firsts)
    return PipelineProfile(
        blocks=tuple(costs[f"block {i}"] for i in range(len(parts.blocks))),
        first=costs.get("first"), last=costs.get("last"), boundary_bytes=boundary, tied_param_bytes=tied,
        source=f"measured on {device.type} ({samples} samples)")
