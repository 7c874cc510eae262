"""From what a job's ranks measured to the Plan they run. Pure: no torch.distributed, no processes.

runtime/measure/joint.py gathers the measurements (each rank's profile, the sync and agreement
probes) in the job's processes; `plan_from_measurements` turns them into the Plan. The runtime
(Engine.prepare) and `hetrain plan --model-factory` (cli/plan_worker.py, then cli/planning.py)
both call it, so the plan `hetrain plan` writes is the one the runtime would make from the same
measurements. `plan_options` is the one place the planner's options are read off the job's
Config; the catalog-estimate path of `hetrain plan` builds its options with it too.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace

from ...hardware.units import format_bytes
from ...planning.collectives import FREE_LINK, Link, link_from_measurement
from ...planning.plan import DevicePlan, Plan
from ...planning.planner import PlanOptions, make_plan
from ...planning.profile import DeviceProfile
from ...emulation import measuring as host_model   # what devices sharing this host make of the measurements
from ...emulation.measuring import clocked_sample_s  # noqa: F401 -- its old home: callers import it from here
from ..config import Config

MEASUREMENTS_SCHEMA = 2          # 2: the CPU cores field renamed (cpu_cores)


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Everything the ranks measured before planning, in rank order; JSON round trip.

    `profiles` is None when there was nothing to measure (one device, memory not limited). The
    probe fields are empty for one device; with W > 1 they hold each rank's row of the sync probe
    (joint.sync_runs runs each) and of the agreement probe."""

    labels: tuple[str, ...]                          # each rank's device
    precisions: tuple[str, ...]                      # each rank's precision, as the plan records it
    profiles: tuple[DeviceProfile, ...] | None       # each rank's own profile (as its device made it)
    cached: tuple[bool, ...] = ()                    # which profiles came from the cache
    grad_bytes: int = 0                              # rank 0's trainable gradient bytes
    cpu_cores: int = 1                               # CPU cores rank 0 may run on
    allreduce_s: tuple[float, ...] = ()              # a gradient-sized all-reduce, seconds
    sync_s: tuple[tuple[float, ...], ...] = ()       # exposed gradient sync, per run
    compute_s: tuple[tuple[float, ...], ...] = ()    # forward+backward before it, per run (0: untimed)
    plain_compute_s: tuple[tuple[float, ...], ...] = ()  # ...through the bare module (no DDP), beside each run
    ddp_over_bare: tuple[tuple[float, ...], ...] = ()    # each run's CPU through DDP over the bare run's (0: untimed)
    agree_s: tuple[float, ...] = ()                  # the per-step agreement all-reduce
    probe_size: int = 0                              # the sync probe's micro-batch (samples)
    # A job of several nodes (runtime/ranks/nodes.py): how many, and one gradient-sized all-reduce
    # among the nodes' leaders only (the inter-node link; 0: one node, not measured).
    nodes: int = 1
    inter_node_s: float = 0.0
    backend: str = ""                                # the process group's: gloo | nccl ('' : one device)
    grad_shapes: tuple[tuple[int, ...], ...] = ()    # rank 0's trainable parameters (PowerSGD's bytes)
    n_params: int = 0                                # rank 0's parameters, all of them (0: not counted)
    n_trainable: int = 0                             # …and those that train (requires_grad)
    # `hetrain plan` only: the blocks' costs as a pipeline would be sized from them (the runtime's
    # measure_blocks) and the devices they were measured for, so the ranking's pipelines are the
    # runtime's: {"profile": PipelineProfile.to_dict(), "devices": [{name, speed, memory_bytes}]}.
    pipeline: dict | None = None
    # `hetrain plan` only: an FSDP2 step's seconds beyond a DDP step's, timed (fsdp_probe.py):
    # {"excess_s", "fsdp_s", "ddp_s", "runs", "pairs" ((DDP, FSDP2) seconds of each run), "micro_batch",
    # "rows" (every rank's), "backend"}.
    fsdp: dict | None = None
    # `hetrain plan` only: a step of the model split by speed, timed (tp_probe.py):
    # {"fb_s", "opt_s", "runs", "micro_batch", "memory" (every rank's [state, activation] bytes)}.
    tp: dict | None = None

    @property
    def world_size(self) -> int:
        return len(self.labels)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["profiles"] = None if self.profiles is None else [p.to_dict() for p in self.profiles]
        return {"schema": MEASUREMENTS_SCHEMA, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Measurements:
        data = dict(data)
        if data.pop("schema", None) != MEASUREMENTS_SCHEMA:
            raise ValueError(f"measurements schema is not {MEASUREMENTS_SCHEMA}: measure again")
        profiles = data.pop("profiles")
        rows = ("sync_s", "compute_s", "plain_compute_s", "ddp_over_bare", "grad_shapes")
        return cls(profiles=None if profiles is None else tuple(DeviceProfile.from_dict(p) for p in profiles),
                   **{k: tuple(tuple(r) for r in v) if k in rows else tuple(v) if isinstance(v, list) else v
                      for k, v in data.items()})

    @classmethod
    def from_json(cls, text: str) -> Measurements:
        return cls.from_dict(json.loads(text))


def plan_options(config: Config, *, grad_bytes: float, link: Link | None, allow_exclusion: bool = False,
                 sync_s: float | None = None, agree_s: float = 0.0,
                 host_memory_bytes: float | None = None) -> PlanOptions:
    """The planner's options for a job with this Config: what the config decides (batch, memory
    margin, micro-batch cap, whether activation checkpointing may be planned) and what was
    measured or estimated (the rest)."""
    return PlanOptions(
        global_batch=config.global_batch, grad_bytes=grad_bytes, link=link, memory_margin=config.memory.margin,
        micro_batch_cap=config.memory.max_micro_batch, allow_exclusion=allow_exclusion,
        allow_checkpointing=config.memory.activation_checkpointing != "none",
        sync_s=sync_s, agree_s=agree_s,
        # what offloaded optimizer state may take; None (no offload) unless given: parallel='auto'
        # plans the sharding it picks without offload (runtime/layouts/choose.py), so it must not
        # pick a row that fits only with it
        host_memory_bytes=host_memory_bytes)


def straggle(compute_s) -> float:
    """How far the last rank to finish a backward trails the ranks' average, as a fraction, when
    all start together on the same micro-batch size: `compute_s[rank][run]`, median over the runs;
    0 when the probe could not time compute (as on a GPU)."""
    fractions = []
    for times in zip(*compute_s):          # one run: every rank's seconds
        if min(times) > 0:                 # a run some rank could not time says nothing
            fractions.append(max(times) / (sum(times) / len(times)) - 1)
    return min(1.0, statistics.median(fractions)) if fractions else 0.0


def planning_profiles(m: Measurements, config: Config) -> tuple[DeviceProfile, ...]:
    """The profiles the planner is given: each rank's, as what its devices share makes them (each
    carries it: DeviceProfile.host, when they share anything; the stragglers the probe measured,
    `straggle`, are in it)."""
    return host_model.planning_profiles(m, config, tuple(m.profiles or ()), straggle(m.compute_s))


def options_from_measurements(m: Measurements, config: Config, *, allow_exclusion: bool = False,
                              link: Link | None = None) -> PlanOptions:
    """The planner's options for these measurements (W > 1: the probes' figures; see below)."""
    n = m.world_size
    measured_link, sync_s, agree_s = FREE_LINK, None, 0.0
    if n > 1 and m.profiles is not None:
        # The last rank to reach the sync waits only for the sync itself; earlier ones also wait
        # for it (on a shared host, whoever the scheduler left behind): in each run the least is
        # the sync; the median run is kept.
        sync_s = statistics.median(min(run) for run in zip(*m.sync_s))
        agree_s = min(m.agree_s)
        slowest = max(m.allreduce_s)
        if m.grad_bytes:
            measured_link = link_from_measurement(
                n, m.grad_bytes, slowest,
                f"measured: a {format_bytes(m.grad_bytes)} all-reduce took {slowest * 1e3:.1f} ms")
            inter = inter_node_link(m)
            if inter is not None and inter.bandwidth_gbs <= measured_link.bandwidth_gbs:
                measured_link = inter            # a ring over the nodes is as fast as its slowest link
    return plan_options(config, grad_bytes=m.grad_bytes, link=link or measured_link, allow_exclusion=allow_exclusion,
                        sync_s=sync_s, agree_s=agree_s)


def inter_node_link(m: Measurements) -> Link | None:
    """The link between the nodes, from the all-reduce among their leaders (None: one node)."""
    if m.nodes < 2 or not m.inter_node_s > 0 or not m.grad_bytes:
        return None
    return link_from_measurement(
        m.nodes, m.grad_bytes, m.inter_node_s,
        f"measured: one {format_bytes(m.grad_bytes)} all-reduce between the {m.nodes} nodes' leaders took "
        f"{m.inter_node_s * 1e3:.1f} ms")


def plan_from_measurements(m: Measurements, config: Config, *, allow_exclusion: bool = False,
                           link: Link | None = None, blocked_by: str | None = None) -> tuple[Plan, tuple[DeviceProfile, ...]]:
    """The Plan a job with this Config runs on these measurements, and the profiles it was made
    from (the runtime keeps them for rebalancing and reports). Every rank of a job calls it on the
    same gathered measurements, so all hold the same Plan without a further exchange.

    The runtime leaves both keywords as they are: every rank's process is running, so each takes
    at least one sample, and the link is the one measured. `hetrain plan` passes
    --allow-exclusion and --link-gbs through them. `blocked_by`: what keeps gradient compression
    off (the layout's word: a sharding asked for, or tensor parallelism taking the plan over).

    On a job of several nodes the plan's notes state the inter-node link, and the gradient
    compression is chosen (planning/compression.py; config.compression.method, 'auto' by default)."""
    if m.profiles is None:                   # a single device with unlimited memory
        return _single_device(m, config), ()
    profiles = planning_profiles(m, config)
    options = options_from_measurements(m, config, allow_exclusion=allow_exclusion, link=link)
    plan = make_plan(list(profiles), options)
    # The rebalancer's time model of each rank: fixed seconds per micro-batch + seconds per sample.
    # The plan's devices are the profiles kept, in order (all of them unless exclusion is allowed).
    left_out = {e.device for e in plan.excluded}
    kept = [p for p in profiles if p.device not in left_out]
    plan = replace(plan, devices=tuple(replace(d, per_sample_s=p.per_sample_s, fixed_s=p.overhead_s)
                                       for d, p in zip(plan.devices, kept)),
                   note="; ".join(filter(None, [plan.note, fine_tuning_note(m)])))
    return _link_and_compression(plan, m, config, options.link, blocked_by), profiles


def fine_tuning_note(m: Measurements) -> str:
    """The plan's word on a model with a frozen part (LoRA and other fine-tuning): its profiles'
    model state was measured as held, so the frozen parameters are weights only. '' otherwise."""
    if not 0 < m.n_params or m.n_trainable >= m.n_params:
        return ""
    return (f"fine-tuning (LoRA or a frozen base): {m.n_trainable:,} of {m.n_params:,} parameters trainable "
            f"({m.n_trainable / m.n_params:.1%}), the frozen {m.n_params - m.n_trainable:,} costed as weights "
            "only (no gradients, no optimizer state) and left out of the gradient sync")


def _link_and_compression(plan: Plan, m: Measurements, config: Config, link: Link | None,
                          blocked: str | None) -> Plan:
    """The inter-node link in the plan's notes, and the gradient compression chosen for it. A
    single-node job is left exactly as it was unless compression was asked for."""
    from ...planning import compression

    inter = inter_node_link(m)
    if inter is not None:
        line = f"inter-node link {inter.bandwidth_gbs:.3g} GB/s{host_model.link_note(config)}, {inter.source}"
        if link is not None and link.source == inter.source:
            line += ": the ring's slowest link"
        plan = replace(plan, note="; ".join(filter(None, [plan.note, line])),
                       predicted={**plan.predicted, "inter_node_gbs": inter.bandwidth_gbs})
    choice = compression.choose(
        config.compression.method, grad_bytes=m.grad_bytes, ring=plan.world_size, link=link or FREE_LINK,
        step_s=plan.predicted.get("step_s", 0.0), exposed_s=plan.predicted.get("comm_exposed_s", 0.0),
        spans_nodes=m.nodes > 1, backend=m.backend, grad_shapes=m.grad_shapes,
        powersgd_rank=config.compression.powersgd_rank, blocked_by=blocked)
    return compression.apply(plan, choice)


def _single_device(m: Measurements, config: Config) -> Plan:
    micro = min(config.global_batch, config.memory.max_micro_batch or config.global_batch)
    return Plan(global_batch=config.global_batch, note="single device: the whole batch", devices=(
        DevicePlan(rank=0, device=m.labels[0], speed=1.0, share=config.global_batch, micro_batch=micro,
                   precision=m.precisions[0],
                   reasons=(f"share {config.global_batch}/{config.global_batch}: single device",
                            f"micro-batch {micro}: " + ("micro_batch set in the config"
                                                       if micro < config.global_batch else "memory not capped"))),))


def profiles_come_from(m: Measurements) -> str:
    """For people: how many profiles were measured and how many reused."""
    cached = sum(m.cached)
    return f"profiles: {cached} of {m.world_size} from the cache, {m.world_size - cached} measured"



def rank_from_measurements(m: Measurements, config: Config, *, state, link: Link | None = None, request=None):
    """Every layout ranked (planning/ranking.rank_layouts) on what the ranks measured, as `hetrain
    plan --model-factory` prints it: the planner's profiles and options, the blocks the runtime
    measured for pipelines, the best as the chooser picks for `request` (None: `auto_request`).
    Returns (ranking or None for one device, profiles, options)."""
    from ...planning.ranking import measured_pipeline, rank_layouts

    profiles = list(planning_profiles(m, config))
    options = options_from_measurements(m, config, link=link)
    pipeline = host_model.pipeline_on_clock(measured_pipeline(m.pipeline), profiles, config)
    ranking = (rank_layouts(profiles, state=state, options=options, pipeline=pipeline,
                            fsdp_excess_s=(m.fsdp or {}).get("excess_s"), tp_measured=m.tp,
                            request=request or auto_request(config))
               if len(profiles) > 1 else None)
    return ranking, profiles, options


def auto_request(config: Config, *, has_loss_fn: bool = True):
    """What parallel='auto' may run for a job of this config (planning/chooser.Request): the
    resilience it asks for (Memory.oom_recovery) and whether it has a loss function (`hetrain plan`
    has no loss function to look at: it ranks as for a job that passes one). An explicit layout
    (DataParallel(sharding=...), Pipeline(...)) never reaches the chooser: it runs as asked."""
    from ...planning.chooser import Request

    return Request(has_loss_fn=has_loss_fn, oom_recovery=config.memory.oom_recovery)


def rank_job_measurements(m: Measurements, config: Config, *, facts: dict, blocks: int | None,
                          link: Link | None = None, has_loss_fn: bool = True):
    """The ranking `hetrain plan --model-factory` prints and parallel='auto' follows: every layout
    on what the job measured (runtime/layouts/ranking.measure_for_ranking), its model state from
    `facts` (ranking.model_facts) with `blocks`, its best the chooser's for this job
    (`auto_request`). Returns rank_from_measurements' triple."""
    from ...planning.ranking import ModelState

    return rank_from_measurements(m, config, link=link, state=ModelState(**{**facts, "blocks": blocks}),
                                  request=auto_request(config, has_loss_fn=has_loss_fn))


def recommended(ranking, request=None):
    """The ranking with its best row re-chosen for `request` (planning/chooser.Request; None: a
    default job's auto), by the one rule (planning/chooser.py); None stays None."""
    from ...planning.chooser import AUTO
    from ...planning.ranking import with_choice

    return None if ranking is None else with_choice(ranking, request or AUTO)
