"""Tensor parallelism split by speed, costed for the layout ranking (pure: no torch).

The runtime's `TensorParallel(split='speed')` (runtime/layouts/tensor/uneven.py) gives rank r a fraction f_r
of every layer's heads and MLP columns, in proportion to its speed v_r = 1 / its seconds per
sample. Each rank computes every sample through its fraction of each layer, so the step is

    max over r of  f_r · (n_micro · a_r + B · b_r)  +  the activation all-reduces  +  max f_r · optimizer_r

(a_r, b_r: the device's seconds per micro-batch and per sample for the whole model; B the global
batch). With f_r = v_r / Σv every rank's part lasts B / Σv: the devices' speeds add up, where the
even split (ranking._tp_row, f_r = 1/W) runs every rank at the slowest one's pace, B · b_slowest / W.
The all-reduces are the even split's: every rank sends and receives the whole activations of
each layer (2 per layer forward, 2 backward), whatever its part. Memory: rank r holds f_r of the
model state; of the activations it saves its part of the sharded layers' outputs and every
replicated one (the residual stream, the norms, the head) whole: 69-77% of the whole model's on
the demo GPT split 60/40 (measured with a saved-tensor meter). Before any run the
row takes the whole model's activations, a bound, and so does the micro-batch every rank runs
(`tp_micro_batch`: the runtime's choice, runtime/layouts/data_setup.tensor_plan, is this one).

That is the model before any run. `hetrain plan` times a step of the split instead
(runtime/layouts/tensor/probe.py), at the micro-batch the runtime will run, and counts what each rank
holds; the row costs and sizes that (`measured`): on gloo the modelled step was 2.5x too fast on
the demo GPT (every layer's all-reduces waited in the calling thread, the small sharded matmuls
and the split's bookkeeping cost CPU, which a CPU-played device is timed by).

`units`: when the head (key/value group) count is known, f_r are the runtime's whole units
(planning.shares.proportional_shares, the same solver the runtime uses); else the exact fractions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ....hardware.units import format_bytes
from ....planning.collectives import allreduce_seconds
from ....planning.options import PlanOptions, ring_link
from ....planning.profile import DeviceProfile
from ....planning.rows import TP_COMM_PER_ACTIVATION, LayoutRow, seconds
from ....planning.shares import proportional_shares

FAMILY = "TP by speed"
RUN = "ht.prepare(..., parallel=hetrain.TensorParallel(split='speed'))"


def speed_fractions(per_sample_s: Sequence[float], units: int | None = None) -> tuple[float, ...]:
    """Each rank's fraction of every layer: ∝ 1 / seconds per sample; in whole `units` if given."""
    speeds = [1 / t for t in per_sample_s]
    if units is not None:
        return tuple(c / units for c in proportional_shares(units, speeds))
    total = sum(speeds)
    return tuple(v / total for v in speeds)


def tp_micro_batch(profiles: Sequence[DeviceProfile], fractions: Sequence[float], *, global_batch: int,
                   margin: float, limit: int | None = None) -> tuple[int, tuple[int, ...]]:
    """(the micro-batch every rank of a TP group runs, each rank's cap): the ranks run in lockstep,
    so the smallest cap, at most the global batch (and `limit`, the user's). A rank's cap is what
    fits beside its fraction f_r of the model state (the profile's fixed bytes) with the whole
    model's activations a micro-batch: a bound, a shard saves less (the module docstring). 0: not
    one sample fits that rank."""
    caps = []
    for p, f in zip(profiles, fractions):
        if p.memory_bytes is None or not p.activation_bytes_per_sample:
            caps.append(global_batch)
            continue
        room = p.memory_bytes * (1 - margin) - f * p.fixed_bytes - p.activation_fixed_bytes
        caps.append(max(0, int(room // p.activation_bytes_per_sample)))
    m = min(min(caps), global_batch)
    return (min(m, limit) if limit else m), tuple(caps)


def measured_memory(profiles: Sequence[DeviceProfile], measured: dict, m: int) -> tuple[float, ...] | None:
    """Each rank's peak at micro-batch m from what the probe counted at its own rows
    (measured["memory"]: [state bytes, activation bytes] a rank), the activations scaled to m as
    the rank's profile scales (c + d·m); None when the probe counted nothing."""
    held, rows = measured.get("memory"), measured.get("micro_batch", 0)
    if not held or len(held) != len(profiles) or rows < 1:
        return None

    def act(p: DeviceProfile, k: int) -> float:
        return p.activation_fixed_bytes + p.activation_bytes_per_sample * k

    return tuple(float(state + a * (act(p, m) / act(p, rows) if act(p, rows) > 0 else 1.0))
                 for p, (state, a) in zip(profiles, held))


def tp_compute_seconds(profiles: Sequence[DeviceProfile], fractions: Sequence[float], *, batch: int,
                       n_micro: int) -> tuple[float, ...]:
    """Each rank's compute seconds per step: its fraction of the whole batch through the whole
    model, and every micro-batch's fixed part whole: a shard runs every layer of every micro-batch
    (as many launches and Python calls as the whole model), so that part does not shrink with f."""
    return tuple(n_micro * p.overhead_s + f * batch * p.per_sample_s for p, f in zip(profiles, fractions))


def tp_comm_seconds(w: int, *, n_micro: int, micro_bytes: float, link, pairs: int = 0, floor_s: float = 0.0) -> float:
    """The activation all-reduces of a step: `micro_bytes` all-reduced a micro-batch. With the
    model's `pairs` known, one all-reduce per pair forward and one backward, each costing at least
    `floor_s` (the measured agreement all-reduce: what a small all-reduce takes on these ranks,
    where a link fitted to a gradient-sized one says almost nothing); else the bytes as one call."""
    if w < 2:
        return 0.0
    if pairs < 1:
        return n_micro * allreduce_seconds(w, micro_bytes, link)
    calls = 2 * pairs
    return n_micro * calls * max(floor_s, allreduce_seconds(w, micro_bytes / calls, link))


def tp_comm_ratio(splits: Sequence[tuple[str, int, int]]) -> float:
    """Bytes all-reduced per byte of saved activations for a model TP splits into these pairs
    (kind 'attention' | 'mlp', the row-parallel layer's output width d, the column-parallel
    layers' width h): a transformer's (TP_COMM_PER_ACTIVATION) when it has attention; else its
    MLP pairs' own: each all-reduces d values forward and d backward per token, and saves its input
    (d), its hidden layer before and after the activation (2h) and hands on d, so 2d / (2d + 2h)
    of what it keeps. The activations outside the pairs are counted as kept too: a bound."""
    if not splits or any(kind == "attention" for kind, _, _ in splits):
        return TP_COMM_PER_ACTIVATION
    return sum(2 * d for _, d, _ in splits) / sum(2 * d + 2 * h for _, d, h in splits)


def speed_tp_row(profiles: Sequence[DeviceProfile], o: PlanOptions, *, units: int | None = None,
                 measured: dict | None = None, comm_per_activation: float = TP_COMM_PER_ACTIVATION,
                 pairs: int = 0) -> LayoutRow:
    """The ranking's row for TP over every device, split by speed (see the module docstring).
    `measured`: a step of this split as `hetrain plan` timed it (runtime/layouts/tensor/probe.py:
    forward + backward of a micro-batch of `micro_batch` rows, the optimizer step); the row's
    micro-batches then cost that, scaled to their rows as the fastest device's profile scales
    (a + b·m), plus hetrain's agreement: the compute and all-reduce model is left out.
    `comm_per_activation`: bytes all-reduced per byte of saved activations (tp_comm_ratio);
    `pairs`: the attention and MLP pairs split (tp_comm_seconds; 0: not known)."""
    w, b = len(profiles), o.global_batch
    name = f"TP {w} by speed"
    fractions = speed_fractions([p.per_sample_s for p in profiles], units)
    held = [f * p.fixed_bytes for p, f in zip(profiles, fractions)]
    m, caps = tp_micro_batch(profiles, fractions, global_batch=b, margin=o.memory_margin)
    if m < 1:
        i = min(range(w), key=lambda k: caps[k])
        return LayoutRow(name=name, family=FAMILY, fits=False, samples_per_s=0.0, memory=(None,) * w,
                         comm_bytes=0.0, comm_s=0.0, run=RUN,
                         detail=f"{fractions[i]:.0%} of the model state ({format_bytes(held[i])}) and one sample's "
                                f"activations do not fit {profiles[i].device}")
    n_micro = math.ceil(b / m)
    compute = tp_compute_seconds(profiles, fractions, batch=b, n_micro=n_micro)
    per_sample = comm_per_activation * max(p.activation_bytes_per_sample for p in profiles)
    comm = tp_comm_seconds(w, n_micro=n_micro, micro_bytes=math.ceil(b / n_micro) * per_sample,
                           link=ring_link(profiles, o), pairs=pairs, floor_s=o.agree_s)
    step = max(compute) + comm + max(f * p.optimizer_s for p, f in zip(profiles, fractions))
    how = (f"the devices finish their parts together ({seconds(max(compute))} of compute); micro-batch "
           f"{m}x{n_micro}, activation all-reduces {seconds(comm)} per step")
    mem = tuple(h + p.activation_fixed_bytes + p.activation_bytes_per_sample * m for p, h in zip(profiles, held))
    timed = bool(measured) and measured.get("fb_s", 0) > 0 and measured.get("micro_batch", 0) > 0
    if timed:
        fast = min(profiles, key=lambda p: p.per_sample_s)
        scale = fast.micro_seconds(math.ceil(b / n_micro)) / fast.micro_seconds(measured["micro_batch"])
        step = n_micro * measured["fb_s"] * scale + measured["opt_s"] + o.agree_s
        how = (f"micro-batch {m}x{n_micro}; a step measured here: {seconds(measured['fb_s'])} forward and "
               f"backward a micro-batch of {measured['micro_batch']}, the optimizer {seconds(measured['opt_s'])}")
    counted = measured_memory(profiles, measured, m) if timed else None
    if counted is not None:
        mem, how = counted, how + ", and what each rank holds counted there"
    else:
        how += "; memory at most its part of the state and the whole model's activations"
    ring = 2 * (w - 1) / w if w > 1 else 0.0
    return LayoutRow(name=name, family=FAMILY, fits=True, samples_per_s=b / step, memory=mem,
                     comm_bytes=ring * b * per_sample, comm_s=comm, run=RUN,
                     detail=f"every layer split {w} ways in proportion to speed "
                            f"({'/'.join(f'{f:.0%}' for f in fractions)} of its heads and MLP columns), so {how}")
