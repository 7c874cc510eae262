"""Capacity-proportional optimizer-state sharding: each device holds optimizer state in
proportion to its free memory, not an equal share.

ZeRO-1 (`ZeroRedundancyOptimizer`), DeepSpeed and FSDP split state evenly, so the smallest card
caps the model. Here every parameter group is laid out as one flat buffer, and so are its
gradients (parameters and `.grad`s become views into them: nothing is copied per step), and rank
r owns the contiguous slice [b_r, b_{r+1}) whose length is proportional to its free memory
(planning/memory.py). One step:

  1. DDP has all-reduced the gradients into the `.grad` views (uneven shares and loss weighting
     unchanged), so every rank has the whole big-batch gradient;
  2. each rank runs the user's optimizer class on its slice alone: one parameter that is a view
     of the flat buffer, whose gradient is the same slice of the flat gradient. Its state exists
     only for the slice;
  3. each owner broadcasts its updated slice into every rank's flat buffer.

`zero_grad()` zeroes the flat gradient in place (the views stay), whatever `set_to_none` says.

The update equals the unsharded one for element-wise optimizers (SGD, Adam/AdamW, RMSprop,
Adagrad, ...): each element sees the same arithmetic. Optimizers with per-tensor statistics
(LAMB, Adafactor, Shampoo...) would see slices instead of tensors, so they are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...errors import UsageError
from ...planning.memory import partition_bounds

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (not its scalar step counts): what it adds to memory."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults that its constructor takes (AdamW's defaults also hold
    'decoupled_weight_decay', which AdamW() does not accept)."""
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def flatten_params(params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """Make `params` and their gradients views into two new contiguous buffers (same values;
    gradients start at zero); returns (params buffer, gradients buffer)."""
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) > 1 or len(devices) > 1:
        raise UsageError(f"capacity sharding needs one dtype and device per parameter group, got "
                         f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}",
                         "put parameters of different dtypes in different optimizer param groups")
    flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
    grads = torch.zeros_like(flat)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.data = flat[offset:offset + n].view_as(p)
            offset += n
    _point_grads(params, grads)
    return flat, grads


def _point_grads(params: Sequence[nn.Parameter], grads: torch.Tensor) -> None:
    """Make every parameter's .grad the view of `grads` it belongs to; a gradient that was
    replaced by a new tensor (set to None, or assigned) is copied back in first."""
    offset = 0
    for p in params:
        n = p.numel()
        view = grads[offset:offset + n].view_as(p)
        g = p.grad
        if g is None or g.data_ptr() != view.data_ptr():
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view
        offset += n


class CapacityShardedOptimizer(torch.optim.Optimizer):
    """Wraps a fresh optimizer: same class, hyperparameters and param groups; state only for this
    rank's slice. `param_groups` are the user's (an LR scheduler works as usual); the slice
    optimizer, `optim`, follows their hyperparameters at every step."""

    def __init__(self, optimizer: torch.optim.Optimizer, fractions: Sequence[float], *, rank: int,
                 world_size: int, group=None):
        if not isinstance(optimizer, ELEMENTWISE):
            raise UsageError(
                f"sharding='capacity' splits parameters into flat slices; {type(optimizer).__name__} "
                "may use per-tensor statistics, which slices would change",
                "use an element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad...), or "
                "sharding='zero1' / 'fsdp'")
        if optimizer.state:
            raise UsageError("sharding='capacity' needs a fresh optimizer (it has state already)",
                             "pass the optimizer to prepare() before any optimizer step")
        if len(fractions) != world_size:
            raise ValueError(f"{len(fractions)} fractions for {world_size} ranks")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.fractions = tuple(fractions)
        groups = [dict(g) for g in optimizer.param_groups]
        super().__init__(groups, optimizer.defaults)
        self._flats, self._grads, self._bounds, self._shards = [], [], [], []
        local_groups = []
        for g in self.param_groups:
            flat, grads = flatten_params(g["params"])
            bounds = partition_bounds(flat.numel(), self.fractions)
            a, b = bounds[rank], bounds[rank + 1]
            shard = nn.Parameter(flat[a:b], requires_grad=True)   # a view: updates land in place
            shard.grad = grads[a:b]                                # a view: no copy per step
            self._flats.append(flat)
            self._grads.append(grads)
            self._bounds.append(bounds)
            self._shards.append(shard)
            local_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [shard]})
        self.optim = type(optimizer)(local_groups, **constructor_defaults(optimizer))

    # -- what this rank holds ------------------------------------------------------------------
    def slice_sizes(self) -> list[list[int]]:
        """Elements each rank owns, per param group."""
        return [[b[r + 1] - b[r] for r in range(self.world_size)] for b in self._bounds]

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer adds to the model state on this rank: the slice's state (its
        parameter and gradient are views of the model's; for memory accounting)."""
        return state_tensors(self.optim)

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradients in place: the `.grad` views must stay (DDP and autograd write
        into them); a parameter without a gradient therefore steps with a zero gradient."""
        for g, grads in zip(self.param_groups, self._grads):
            grads.zero_()
            _point_grads(g["params"], grads)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise UsageError("sharding='capacity' does not take an optimizer closure",
                             "call step() without a closure (hetrain's ht.step() does)")
        for gi, g in enumerate(self.param_groups):
            local = self.optim.param_groups[gi]
            for k, v in g.items():          # LR schedulers and users change the exposed groups
                if k != "params":
                    local[k] = v
            _point_grads(g["params"], self._grads[gi])   # normally a no-op: the views are in place
        self.optim.step()
        for flat, bounds in zip(self._flats, self._bounds):
            for r in range(self.world_size):
                if bounds[r + 1] > bounds[r]:
                    dist.broadcast(flat[bounds[r]:bounds[r + 1]], src=dist.get_global_rank(self.group, r)
                                   if self.group is not None else r, group=self.group)
        return None

    def layout(self) -> list[tuple[list[nn.Parameter], list[int], nn.Parameter]]:
        """Per param group: its parameters (in flat-buffer order), the slice bounds of every rank,
        and this rank's slice parameter (what `optim` steps). For checkpoints (sharding/state.py)."""
        return [(list(g["params"]), list(bounds), shard)
                for g, bounds, shard in zip(self.param_groups, self._bounds, self._shards)]

    # -- checkpoints go through sharding/state.py (every rank contributes its slice, keyed by
    # parameter name); the base class's state_dict would silently hold this rank's slice alone.
    def state_dict(self):
        raise UsageError("a capacity-sharded optimizer's state is split over the ranks: it has no "
                         "state_dict of its own",
                         "checkpoint with hetrain.init(checkpoints=Checkpoints(dir=...)), which saves every rank's slice")

    def load_state_dict(self, state_dict):
        raise UsageError("a capacity-sharded optimizer's state is split over the ranks: it has no "
                         "load_state_dict of its own",
                         "resume with hetrain.init(checkpoints=Checkpoints(dir=...)), which loads every rank's slice")
