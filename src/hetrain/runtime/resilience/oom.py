"""Out-of-memory recovery without deadlock: agree first, then act.

Where an OOM can strike, and what keeps the peers safe:
  * Any micro-batch but the last, forward or backward: it runs under no_sync(), so no collective
    is in flight. The rank alone zeroes its gradients, halves its micro-batch and redoes its part
    of the step; the peers simply wait a little longer at the step's gradient sync.
  * The last micro-batch's forward: DDP has not armed its reducer yet (that happens after the
    forward), so this is local too.
  * The last micro-batch's backward: DDP is all-reducing gradient buckets as they become ready,
    and the peers are inside those all-reduces. `SyncGuard` records which buckets this backward
    launched; after the OOM the rank all-reduces zeros for every bucket it still owes, in bucket
    order (DDP launches buckets strictly in index order), through the same comm hook its peers run
    (compressed or not: runtime/sharding/comm_hooks.py), so every peer's collective completes.
    Then the step's small all-reduce (runtime/ranks/agree.py) tells every rank; all discard the step's
    gradients, reset DDP's reducer and redo the step with the smaller micro-batch.
Releasing before allocating. Right after a real OOM the device is full, and the failed graph holds
most of it: the `except` block's traceback, the loss (and the scaled loss) point to it. So the
caller leaves the `except` block first, drops the graph (`release_graph`: the loss detached in
place, so the caller's tensor no longer holds it), frees the abandoned step's gradients, returns
the allocator's cache (`free_cached`), and only then completes the sync, one bucket's zeros at a
time (a full gradient's zeros at once would fail a second time, with the peers inside NCCL).
Under FSDP2 collectives run in every micro-batch's forward and backward; there every OOM is
completed and agreed like the last backward's (runtime/sharding/fsdp_guard.py says how).
Every rank reports its micro-batch size in that same all-reduce, so the new size enters the Plan
(a new version) on every rank at once. A rank that cannot shrink further (micro-batch 1) reports
it, and all ranks stop together with the reason, rather than one rank leaving its peers waiting.
If an OOM escapes the loop (outside `with mb:`), the job restarts from its last checkpoint and
the rank's micro-batch is halved there (`record_escaped_oom`, applied on resume).
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import threading

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from ...files import write_json_atomic

OOM_RECORD = "oom-rank{rank}.json"


class SyncGuard:
    """DDP's gradient all-reduce as a comm hook (runtime/sharding/comm_hooks.py GradientHook: plain,
    compressed, through a slowed link), plus a record of the buckets each backward launched."""

    def __init__(self, ddp: DDP, gradient):
        self.ddp = ddp
        self.gradient = gradient          # a runtime/sharding/comm_hooks.py GradientHook
        self.launched: list[int] = []
        self.allocating = contextlib.nullcontext   # a metered device meters the completion (MemoryMeter.allocating)
        ddp.register_comm_hook(self, SyncGuard.hook)

    @staticmethod
    def hook(self, bucket):   # unannotated: DDP rejects string annotations (postponed evaluation)
        future = self.gradient(bucket)
        self.launched.append(bucket.index())     # once issued: a hook that raised still owes its bucket
        return future

    every_oom_desyncs = False    # an OOM outside the last backward leaves no collective owed

    def start_attempt(self) -> None:
        """A step's attempt begins: DDP's sync is all in the last backward, nothing to note."""

    def begin(self) -> None:
        self.launched.clear()
        self.gradient.begin()        # PowerSGD's state, as it was before this backward

    def complete_missing(self) -> int:
        """Run the gradient hook on zeros for every bucket this backward did not launch, in bucket
        order, so each peer's collective meets what it expects (a compressed hook's dtype, size and
        number of all-reduces); returns how many. One buffer, the largest missing bucket's size,
        serves every bucket, zeroed again for each: a collective's tensor may outlive its wait
        (NCCL's watchdog holds it until it sees the work done), so a fresh one per bucket could
        hold several at once."""
        launched = set(self.launched)
        with self.allocating():
            buckets = bucket_layout(self.ddp)
            missing = [b for b in buckets if b.index() not in launched]
            shared: dict = {}     # (dtype, device): the one buffer
            for bucket in missing:
                meta = bucket.buffer()
                if meta.is_meta:
                    key = (meta.dtype, bucket.parameters()[0].device)
                    if key not in shared:
                        size = max(b.buffer().numel() for b in missing if b.buffer().dtype == meta.dtype)
                        shared[key] = torch.empty(size, dtype=key[0], device=key[1])
                    bucket.set_buffer(shared[key][:meta.numel()].zero_())
                self.gradient(bucket).wait()
                bucket.set_buffer(meta)
        return len(missing)

    def redo(self) -> None:
        """Every rank agreed to redo the step: the hook's state as before the failed attempt."""
        self.gradient.redo()


class _BucketShapes(TorchDispatchMode):
    """The reducer's zero buckets as meta tensors: their shapes, dtypes and parameters, no memory."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.zeros_like.default:
            return torch.empty_like(args[0], device="meta")
        return func(*args, **(kwargs or {}))


def bucket_layout(ddp: DDP) -> list:
    """DDP's gradient buckets, in index order, with meta buffers (`set_buffer` gives one its
    zeros). Where the reducer's allocation is out of reach of the dispatch mode, the buffers come
    back real (zeros for every bucket at once, as torch's own API gives them)."""
    with _BucketShapes():
        return ddp.reducer._get_zeros_like_grad_buckets()


def release_graph(device: torch.device, *tensors) -> None:
    """After a failed backward: detach these tensors in place (the loss the caller still holds),
    then drain the autograd engine. torch's engine keeps the nodes a failed backward had queued
    (and the graph behind them) in the thread's ready queue until a later backward pops them, so
    dropping every reference frees nothing until then; a backward through a node older than any
    training graph (`keep_anchor`) pops them first (the queue runs newest nodes first) and drops
    them. A view cannot be detached in place: it keeps its graph until its holder lets go."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            try:
                t.detach_()
            except RuntimeError:
                pass
    thread = threading.get_ident()
    for where in dict.fromkeys((torch.device(device), torch.device("cpu"))):
        anchor = _ANCHORS.get((thread, where))
        if anchor is not None:
            leaf, node = anchor
            node.backward(retain_graph=True)
            leaf.grad = None


_ANCHORS: dict = {}     # (thread, device): (leaf, a one-node graph made before any training graph)


def keep_anchor(device: torch.device) -> None:
    """Make this thread's anchors (on `device` and the CPU), before its first training forward."""
    thread = threading.get_ident()
    for where in dict.fromkeys((torch.device(device), torch.device("cpu"))):
        if (thread, where) not in _ANCHORS:
            leaf = torch.zeros((), device=where, requires_grad=True)
            _ANCHORS[(thread, where)] = (leaf, leaf * 1.0)


def free_cached(device: torch.device) -> None:
    """After an OOM, once the failed graph's references are gone: collect what a reference cycle
    still holds, and hand the CUDA allocator's cached blocks back, so the completion and the redo
    find the memory the failed step had."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def install(ddp: DDP, gradient, *, guard: bool) -> SyncGuard | None:
    """The gradient sync on `ddp` (gradient: a runtime/sharding/comm_hooks.py GradientHook):
    through a SyncGuard when `guard` (returned), else the GradientHook registered directly when it
    does anything DDP's own all-reduce would not (None returned)."""
    if guard:
        return SyncGuard(ddp, gradient)
    if gradient.needed:
        ddp.register_comm_hook(gradient, type(gradient).ddp_hook)
    return None


def reset_reducer(sync) -> None:
    """Let the synchroniser run a forward again after a step that did not finish (all ranks call
    this): DDP's reducer reset, or FSDP2's (runtime/sharding/wrap.py FSDPSync.reset)."""
    if not isinstance(sync, DDP):
        sync.reset()
        return
    ddp = sync
    ddp.reducer._reset_state()


def smaller_micro_batch(micro: int) -> int | None:
    """The next micro-batch size to try after an OOM, or None when it is already 1."""
    return None if micro <= 1 else max(1, micro // 2)


# -- an OOM that escaped the loop: recorded now, applied when the job resumes ----------------------
# A record counts only for the next attempt of the same launch: torchrun's run id (the same over its
# restarts, new for every launch) is in it, and a new launch (restart 0) or a rank now beyond the
# world size finds nothing to apply. Rank 0 removes every record once all ranks have read them.
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def record_escaped_oom(directory: str, *, rank: int, micro: int, step: int) -> None:
    write_json_atomic(os.path.join(directory, OOM_RECORD.format(rank=rank)),
                      {"rank": rank, "micro": micro, "step": step, "run_id": os.environ.get(RUN_ID_ENV)})


def take_escaped_ooms(directory: str, world_size: int, *, restart: int) -> dict[int, int]:
    """{rank: micro-batch it ran out of memory with} from the previous attempt of this launch
    (every rank reads them; rank 0 removes them once all have). A record that cannot be read is
    no record."""
    found = {}
    if restart == 0:   # the first attempt of a launch: anything here is another launch's
        return found
    for rank in range(world_size):
        try:
            with open(os.path.join(directory, OOM_RECORD.format(rank=rank))) as f:
                rec = json.load(f)
            if rec.get("run_id") == os.environ.get(RUN_ID_ENV) and int(rec["micro"]) >= 1:
                found[rank] = int(rec["micro"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def clear_escaped_ooms(directory: str) -> None:
    """Every record in `directory`, of any rank."""
    for path in glob.glob(os.path.join(glob.escape(directory), OOM_RECORD.format(rank="*"))):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
