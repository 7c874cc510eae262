"""DDP's gradient all-reduce as one communication hook: torch's own compression hooks, the link
the collectives cross beyond the process group's transport where the job has one
(DeviceMeasuring.link), and what OOM recovery needs from them.

    none       default_hooks.allreduce_hook            (what DDP does without a hook)
    fp16       default_hooks.fp16_compress_hook
    bf16       default_hooks.bf16_compress_hook        (NCCL only; refused on gloo: planning/compression.py)
    powersgd   powerSGD_hook.powerSGD_hook with PowerSGDState(matrix_approximation_rank=powersgd_rank,
               start_powerSGD_iter=2, use_error_feedback=True, warm_start=True), torch's defaults otherwise

Every one divides by the world size as DDP does, so hetrain's loss weighting W·n/B (runtime/loop/reduce.py)
gives the big-batch gradient through them as through plain DDP (fp16/bf16 to their rounding).

DDP takes one hook. OOM recovery's `SyncGuard` (runtime/resilience/oom.py) is that hook when OOM
recovery is on, and calls `GradientHook` for every bucket; otherwise `resilience.oom.install` registers the
GradientHook itself (or nothing, when it would only do what DDP does without a hook). After an OOM
the guard completes the buckets its peers still wait for by running this same hook on zero
buckets of the same shapes (the reducer's `_get_zeros_like_grad_buckets`), so the peers' compressed
collectives meet exactly the dtypes, sizes and number of all-reduces they expect.

PowerSGD's state across an OOM. Its error feedback (per bucket: what compression dropped, added
back next step), its warm-start factors and its step counter change in every synchronised backward,
on every rank. An OOM in the last backward leaves that state changed by an attempt that is then
thrown away: partly by the real gradients, partly by the zeros that completed it. So the guard
keeps a copy at the start of each step's last backward (`begin`; one gradient-sized buffer, the
error feedback, plus the small factors) and every rank puts it back before the agreed redo
(`redo`), which then compresses exactly as the first attempt would have. PowerSGD's state is
not checkpointed: a resumed job starts it afresh (its first 2 steps uncompressed again).

PowerSGD on gloo. Its hook issues its second and third all-reduce from the first one's completion,
which gloo runs on a worker thread: with several buckets in flight, two ranks can issue the
buckets' collectives in different orders and mismatch ("Received data size doesn't match expected
size", measured with 6 buckets). On gloo a bucket's PowerSGD therefore waits for the previous
bucket's to finish (`serial`): no overlap between buckets, the right order on every rank. NCCL
runs the chain on the calling thread, in order: nothing is serialised there.
"""

from __future__ import annotations


import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from ..devices import clock as clocks
from ...planning.compression import POWERSGD_START_ITER

HOOKS = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
         "bf16": default_hooks.bf16_compress_hook, "powersgd": powersgd.powerSGD_hook}


class GradientHook:
    """One bucket's all-reduce as `compression` sends it, through `link` when given (what the
    collectives cross beyond the transport: `then(future, started, nbytes)`, DeviceMeasuring.link).
    `device_waits`: the device's work runs at the host's sync points (DeviceHooks.syncs_at_collectives),
    so a bucket leaves once its gradients are computed."""

    def __init__(self, compression: str = "none", *, powersgd_rank: int = 4, link=None, backend: str = "gloo",
                 device_waits: bool = False):
        if compression not in HOOKS:
            raise ValueError(f"compression {compression!r} is not one of {', '.join(HOOKS)}")
        self.compression = compression
        self.inner = HOOKS[compression]
        self.state = None
        if compression == "powersgd":
            self.state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=POWERSGD_START_ITER, use_error_feedback=True, warm_start=True)
        self.link = link
        self.device_waits = device_waits
        self.serial = compression == "powersgd" and backend == "gloo"
        self._previous = None
        self._saved = None

    @property
    def needed(self) -> bool:
        """Does it do anything DDP's own all-reduce would not?"""
        return self.compression != "none" or self.link is not None or self.device_waits

    def __call__(self, bucket) -> torch.futures.Future:
        if self.device_waits:
            clocks.sync_point()
        if self.serial and self._previous is not None:
            self._previous.wait()
        if self.link is None:                # compression alone: nothing to time or count
            future = self.inner(self.state, bucket)
        else:
            future = self._over_link(bucket)
        if self.serial:
            self._previous = future
        return future

    def _over_link(self, bucket) -> torch.futures.Future:
        """The bucket's collective, handed to the link with the bytes it sends."""
        started = clocks.host()
        buffer = bucket.buffer()
        sent = float(buffer.numel() * buffer.element_size())
        state = self.state
        vanilla = state is None or state.iter < state.start_powerSGD_iter
        before = state.total_numel_after_compression if state is not None else 0
        future = self.inner(state, bucket)
        if self.compression in ("fp16", "bf16"):
            sent = buffer.numel() * 2.0
        elif not vanilla:                    # what this bucket's PowerSGD all-reduces (its factors, the rest whole)
            sent = (state.total_numel_after_compression - before) * float(buffer.element_size())
        return self.link.then(future, started, sent)

    @staticmethod
    def ddp_hook(self, bucket):   # unannotated: DDP rejects string annotations (postponed evaluation)
        return self(bucket)

    # -- OOM recovery (runtime/resilience/oom.py SyncGuard) --------------------------------------
    def begin(self) -> None:
        """A step's last backward is about to run: keep PowerSGD's state as it is now."""
        s = self.state
        if s is None:
            return
        self._saved = {"iter": s.iter, "rng": s.rng.get_state(),
                       "stats": (s.total_numel_before_compression, s.total_numel_after_compression),
                       **{name: {k: v.detach().clone() for k, v in getattr(s, name).items()}
                          for name in ("error_dict", "p_memory_dict", "q_memory_dict")}}

    def redo(self) -> None:
        """Every rank agreed to redo the step: PowerSGD's state back to what `begin` kept."""
        s, saved = self.state, self._saved
        if s is None or saved is None:
            return
        s.iter = saved["iter"]
        s.rng.set_state(saved["rng"])
        s.total_numel_before_compression, s.total_numel_after_compression = saved["stats"]
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            setattr(s, name, {k: v.clone() for k, v in saved[name].items()})


def settle(plan, *, request: str, strategy: str, backend: str, world_size: int):
    """The plan's compression as this wrapper can run it (every rank decides alike: the strategy
    comes from values all exchanged). `request`: the Config's; 'auto' keeps the plan's (measured,
    or a given plan's), an explicit one is recorded in the plan. Sharding the planner chose
    (DataParallel(sharding=None)) turns an automatic choice off, with a note, and refuses an explicit one (one line)."""
    from dataclasses import replace

    from ...planning.compression import check_request

    name = "none" if world_size == 1 else plan.compression if request == "auto" else request
    if name != "none" and strategy != "none":
        if request != "auto":
            check_request(request, backend=backend, blocked_by=f"sharding {strategy!r} (DataParallel(sharding=None) chose it)")
        return replace(plan, compression="none", note=with_note(
            plan.note, f"gradient compression none: the planner chose sharding {strategy} (compression is for "
                       "plain data parallelism, DataParallel(sharding='none'))"))
    if name != "none":
        check_request(name, backend=backend)      # a given plan's bf16 on gloo, say
    if name == plan.compression:
        return plan
    note = f"gradient compression {name} (asked for)" if name != "none" else ""
    return replace(plan, compression=name, note=with_note(plan.note, note))


def with_note(note: str, reason: str) -> str:
    """The plan's note with `reason` added, once: a plan completed again (a resumed one) says it once."""
    said = note.split("; ") if note else []
    return "; ".join(said + [reason]) if reason and reason not in said else note
