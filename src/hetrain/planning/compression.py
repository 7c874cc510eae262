"""Gradient compression, planned: what each option would send, how long its sync and step would
be, and which one a job runs. Pure: no torch, no processes.

The options are torch's own DDP communication hooks (runtime/sharding/comm_hooks.py runs them):

    none       DDP's fp32 all-reduce                       S bytes
    fp16       fp16_compress_hook: cast, all-reduce, cast   S/2 (fp32 gradients)
    bf16       bf16_compress_hook: the same in bf16         S/2 (NCCL only: TypeError on gloo)
    powersgd   powerSGD_hook, rank r: every gradient matrix n×m sent as two factors (n+m)·r, the
               rest (biases, small matrices) uncompressed; three all-reduces per bucket

fp16 and bf16 round each rank's contribution and the sum (fp16: ~5e-4 relative per element, with a
range of ±65504; bf16: ~4e-3, fp32's range): within float tolerance of the big-batch gradient,
since hetrain's uneven-batch weighting is in the loss (runtime/loop/reduce.py), before the hook.
PowerSGD is an approximation (a low-rank projection; error feedback carries what it dropped into
the next step): it changes the training's path, so 'auto' never picks it, and says so when it
would gain a lot more.

The prediction. The step's exposed gradient sync, as the plan has it (measured through DDP at the
start of a runtime job), shrinks with the bytes sent: the part of it that the link explains (the
ring all-reduce of the gradient over the slowest link, planning/cost.py `gradient_sync`) scales
by the ring model of the compressed bytes; anything measured beyond that (hook and launch costs)
stays. Compute is unchanged; the compression's own compute (a cast; PowerSGD's small matmuls) is
not modelled. 'auto' picks fp16 (bf16 on NCCL: same bytes, fp32's range) when the job spans
nodes and the predicted samples/s gain is at least MIN_GAIN; within one node the link is fast
and the plan is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import UsageError
from ..vocabulary import COMPRESSION_REQUESTS, COMPRESSIONS, check_choice
from .collectives import Link
from .cost import gradient_sync
from .plan import Plan

MIN_GAIN = 0.05              # 'auto' compresses for a predicted samples/s gain of at least this
POWERSGD_NOTE_MARGIN = 0.10  # ...and names PowerSGD when it would gain this much more on top
POWERSGD_MIN_COMPRESSION_RATE = 2.0   # torch's PowerSGDState default: compress a matrix only when it halves
ROUNDS = {"none": 1, "fp16": 1, "bf16": 1, "powersgd": 3}   # all-reduces per bucket (latency)
# PowerSGD sends its first steps uncompressed (torch's start_powerSGD_iter; 2 is the least torch
# allows with error feedback: DDP rebuilds its buckets after the first step). torch suggests ~10%
# of training for accuracy; hetrain starts at once so that a run shows the gain it was asked for,
# and its loss band is tested on that (tests/dist/test_compression.py).
POWERSGD_START_ITER = 2


@dataclass(frozen=True, kw_only=True)
class CompressionOption:
    """One option's predicted step."""

    name: str
    sent_bytes: float        # what each rank all-reduces per step
    sync_s: float            # the step's exposed gradient sync
    step_s: float

    def gain(self, base: CompressionOption) -> float:
        """Predicted samples/s gain over `base`, as a fraction (0.18: +18%)."""
        return base.step_s / self.step_s - 1 if self.step_s > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class CompressionChoice:
    """What the job runs, and the line printed with the plan ('' when there is nothing to say)."""

    name: str
    reason: str = ""
    options: tuple[CompressionOption, ...] = ()

    def option(self, name: str) -> CompressionOption | None:
        return next((o for o in self.options if o.name == name), None)


def powersgd_elements(shapes: Sequence[Sequence[int]], rank: int,
                      min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> int:
    """Elements PowerSGD all-reduces for gradients of these shapes, as torch's powerSGD_hook
    decides: each tensor viewed as (shape[0], rest); compressed to (n + m)·r' (r' = min(n, m, r))
    when that is under n·m / min_compression_rate, else sent whole (so biases always are)."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) == 0 or numel == 0:
            total += numel
            continue
        n = shape[0]
        m = numel // n
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if compressed * min_compression_rate < numel else numel
    return total


def sent_bytes(name: str, *, grad_bytes: float, grad_shapes: Sequence[Sequence[int]] = (),
               powersgd_rank: int = 4) -> float | None:
    """Bytes each rank all-reduces per step under `name` (None: PowerSGD without the shapes)."""
    numel = sum(math.prod(s) for s in grad_shapes) if grad_shapes else grad_bytes / 4
    element = grad_bytes / numel if numel else 4.0
    if name == "none":
        return float(grad_bytes)
    if name in ("fp16", "bf16"):
        return numel * min(2.0, element)
    if not grad_shapes:
        return None
    return powersgd_elements(grad_shapes, powersgd_rank) * element


def predict(*, grad_bytes: float, ring: int, link: Link, step_s: float, exposed_s: float,
            grad_shapes: Sequence[Sequence[int]] = (), powersgd_rank: int = 4,
            window_s: float = 0.0) -> tuple[CompressionOption, ...]:
    """Every option's sync and step (see the module docstring), 'none' first. `exposed_s`: the
    plan's exposed sync, of its `step_s`; `window_s`: backward left to hide the sync under (0
    where the exposed sync was measured: what it hid is already out of it)."""
    base = gradient_sync(ring, grad_bytes, link, backward_window_s=window_s).exposed_s
    explained = min(exposed_s, base)
    out = []
    for name in COMPRESSIONS:
        sent = sent_bytes(name, grad_bytes=grad_bytes, grad_shapes=grad_shapes, powersgd_rank=powersgd_rank)
        if sent is None:
            continue
        sync = exposed_s
        if base > 0 and sent > 0 and name != "none":
            # the same ring over a link as much faster as the bytes are fewer (buckets included)
            faster = Link(bandwidth_gbs=link.bandwidth_gbs * grad_bytes / sent,
                          latency_s=link.latency_s * ROUNDS[name])
            model = gradient_sync(ring, grad_bytes, faster, backward_window_s=window_s).exposed_s
            sync = exposed_s - explained + explained * model / base
        out.append(CompressionOption(name=name, sent_bytes=sent, sync_s=sync, step_s=step_s - exposed_s + sync))
    return tuple(out)


def check_request(request: str, *, backend: str, blocked_by: str | None = None) -> None:
    """An explicit request that cannot run here: one line naming the fix (auto never raises)."""
    check_choice(request, COMPRESSION_REQUESTS, "compression")
    if request in ("auto", "none"):
        return
    if blocked_by:
        raise UsageError(f"Compression(method={request!r}): gradient compression is a DDP communication hook of plain "
                         f"data parallelism, and this job runs {blocked_by}",
                         "for compression use parallel=hetrain.DataParallel(sharding='none'), or leave "
                         "Compression(method='auto')")
    if request == "bf16" and backend != "nccl":
        # torch's bf16_compress_hook raises TypeError on gloo (measured, torch 2.13): refused up front
        # rather than swapped for fp16, whose range (±65504) is not bf16's
        raise UsageError(f"Compression(method='bf16') needs NCCL (CUDA): torch's bf16_compress_hook does not run on "
                         f"{backend or 'gloo'} (CPU devices)",
                         "use Compression(method='fp16') (the same bytes saved), or 'auto'")


def choose(request: str, *, grad_bytes: float, ring: int, link: Link, step_s: float, exposed_s: float,
           spans_nodes: bool, backend: str, grad_shapes: Sequence[Sequence[int]] = (), powersgd_rank: int = 4,
           blocked_by: str | None = None, window_s: float = 0.0) -> CompressionChoice:
    """What the job's gradient all-reduce sends, and why. `request`: the Config's compression;
    `blocked_by`: what makes compression impossible here ("parallel='tp'", "sharding='fsdp'"),
    None when plain DDP runs. An explicit request that cannot run raises (check_request)."""
    check_request(request, backend=backend, blocked_by=blocked_by)
    if request == "none" or (request == "auto" and not spans_nodes):
        return CompressionChoice(name="none")        # one node: nothing new said
    if blocked_by:
        return CompressionChoice(name="none", reason=f"gradient compression none: this job runs {blocked_by} "
                                 "(compression is for plain data parallelism, DataParallel(sharding='none'))")
    if ring <= 1:
        return CompressionChoice(name="none", reason="gradient compression none: one device, no gradient sync"
                                 + (f" (Compression(method={request!r}) asked for)" if request != "auto" else ""))
    options = predict(grad_bytes=grad_bytes, ring=ring, link=link, step_s=step_s, exposed_s=exposed_s,
                      grad_shapes=grad_shapes, powersgd_rank=powersgd_rank, window_s=window_s)
    by_name = {o.name: o for o in options}
    none = by_name["none"]
    where = f"{'inter-node ' if spans_nodes else ''}link {link.bandwidth_gbs:.3g} GB/s"
    if not math.isfinite(link.bandwidth_gbs) or none.sync_s <= 0:
        where = "communication not measured" if not math.isfinite(link.bandwidth_gbs) else "no exposed sync"

    def effect(o: CompressionOption) -> str:
        return (f"sync {none.sync_s * 1e3:.3g} ms -> {o.sync_s * 1e3:.3g} ms, "
                f"predicted {o.gain(none):+.0%} samples/s")

    if request != "auto":
        chosen = by_name.get(request)
        what = effect(chosen) if chosen is not None else "no prediction (the gradient's shapes were not measured)"
        # a separate line of the plan's note (show_plan prints one per '; ')
        extra = (f"; PowerSGD rank {powersgd_rank} approximates the gradient (error feedback carries what it "
                 f"drops into the next steps, and the first {POWERSGD_START_ITER} steps are sent uncompressed)"
                 if request == "powersgd" else "")
        return CompressionChoice(name=request, options=options,
                                 reason=f"gradient compression {request} (asked for): {where}, {what}{extra}")
    pick = "bf16" if backend == "nccl" else "fp16"
    candidate = by_name[pick]
    gain = candidate.gain(none)
    name = pick if gain >= MIN_GAIN else "none"
    if name == pick:
        reason = f"gradient compression {pick}: {where}, {effect(candidate)}"
    else:
        reason = (f"gradient compression none: {where}, {pick} would give {effect(candidate)} "
                  f"(under the {MIN_GAIN:.0%} it takes)")
    powersgd = by_name.get("powersgd")
    best = max(gain, 0.0) if name == pick else 0.0
    if powersgd is not None and powersgd.gain(none) >= best + POWERSGD_NOTE_MARGIN:
        reason += (f"; PowerSGD (rank {powersgd_rank}) would give {effect(powersgd)}, but it approximates the "
                   "gradient: ask for it with Compression(method='powersgd')")
    return CompressionChoice(name=name, reason=reason, options=options)


def apply(plan: Plan, choice: CompressionChoice) -> Plan:
    """The plan running `choice`: its compression, the reason in its note, and its predicted
    step as compressed (the uncompressed one kept beside it). Same version: a record."""
    if not choice.reason and choice.name == plan.compression:
        return plan
    predicted = dict(plan.predicted)
    chosen, none = choice.option(choice.name), choice.option("none")
    if choice.name != "none" and chosen is not None and none is not None and chosen.step_s > 0:
        rate = plan.global_batch / chosen.step_s
        predicted.update(uncompressed_step_s=none.step_s, uncompressed_samples_per_s=plan.global_batch / none.step_s,
                         step_s=chosen.step_s, samples_per_s=rate, comm_exposed_s=chosen.sync_s,
                         compressed_bytes=chosen.sent_bytes)
        if predicted.get("standalone_sum_samples_per_s"):
            predicted["efficiency"] = rate / predicted["standalone_sum_samples_per_s"]
    note = "; ".join(filter(None, [plan.note, choice.reason]))
    return replace(plan, compression=choice.name, note=note, predicted=predicted)
