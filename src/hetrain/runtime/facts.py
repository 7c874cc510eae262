"""What integrations (and users) read and ask of a job through the Engine: they hold the Engine,
never its job record, and change the Config only through these methods."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError
from .resilience import resume as persist


class EngineFacts:
    """The Engine's read-only facts and the few changes an integration makes; `job` is the Engine's."""

    job: Any
    _prepared: bool

    model = property(lambda self: self.job.model)            # the prepared model (None before prepare)
    optimizer = property(lambda self: self.job.optimizer)    # the one steps act on (sharding may replace yours)
    sampler = property(lambda self: self.job.sampler)        # the global sample order: cursor, dataset_len, ...
    compute_dtype = property(lambda self: self.job.precision.dtype)   # None: fp32
    oom_guard = property(lambda self: self.job.guard)        # the gradient sync's OOM settling, when on

    @property
    def node_rank(self) -> int | None:
        nodes = self.job.nodes
        return nodes.node_of[self.job.rank] if nodes is not None else None

    @property
    def checkpoint_dir(self) -> str | None:
        """Where the job's own checkpoints go (None without checkpoint_dir)."""
        return str(self.job.checkpointer.dir) if self.job.checkpointer is not None else None

    @property
    def clips_in_slices(self) -> bool:
        """Whether the gradient lives in slices (capacity-full) that only clip_grad_norm can clip."""
        return hasattr(self.job.sync, "clip_grad_norm")

    def step_skipped(self, index: int) -> bool:
        """Whether step `index` skipped its optimizer step for inf/NaN gradients (every rank agreed)."""
        return index in self.job.precision.skipped_steps

    def clip_grad_norm(self, max_norm: float, *, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip the step's global gradient to `max_norm`; returns the norm before clipping. Inside a
        step, after the gradient is final. An fp16 step the scaler will skip is no error."""
        job = self.job
        if hasattr(job.sync, "clip_grad_norm"):     # capacity-full: the slices' norms summed over the ranks
            return job.sync.clip_grad_norm(max_norm)
        return torch.nn.utils.clip_grad_norm_([p for p in job.model.parameters() if p.grad is not None], max_norm,
                                              norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite and job.precision.scaler is None)

    def configure(self, **settings) -> None:
        """Change Config fields before prepare() (an integration learns the batch and data order
        from the user's DataLoader); checked as Config(...) checks them."""
        if self._prepared:
            raise UsageError(f"configure({', '.join(settings)}) after prepare()", "configure the job before prepare()")
        self.job.reconfigure(**settings)

    def set_grad_clip(self, max_norm: float | None) -> None:
        """Clip every following step's global gradient norm to `max_norm` (None: no clipping)."""
        if self.job.config.grad_clip != max_norm:
            self.job.reconfigure(grad_clip=None if max_norm is None else float(max_norm))

    def extend_run(self, steps: int) -> None:
        """Run at least `steps` more steps than done so far (a loop that decides the run's length)."""
        self.job.run.total_steps = max(self.job.total_steps, self.job.steps_done + steps)

    def save_state(self, directory: str) -> str:
        """A whole checkpoint of the job in `directory` (a collective, at a step boundary); its path."""
        return str(persist.save_in(self.job, directory))

    def load_state(self, directory: str, *, batch_hint: str) -> bool:
        """Continue from `directory`'s newest checkpoint (a collective, after prepare, before the
        first step); False when there is none. `batch_hint`: how to keep the global batch."""
        return persist.load_from(self.job, directory, batch_hint=batch_hint)
