"""Model parallelism a user may reach for directly (the layouts run it for them: prepare(parallel=...)).

    PipelineParts(first=, blocks=, last=)   describe a model's blocks for pipelines
    tensor_parallel(model, mesh=None)       DTensor tensor parallelism of any transformer-like model
    tp_plan(model, size)                    the parallel styles it would apply, to check first

The code is in runtime/layouts/ (it runs inside each rank, on torch.distributed).
"""

from .runtime.layouts.pipeline.blocks import PipelineParts, find_parts
from .runtime.layouts.tensor.shard import tensor_parallel, tp_plan

__all__ = ["PipelineParts", "find_parts", "tensor_parallel", "tp_plan"]
