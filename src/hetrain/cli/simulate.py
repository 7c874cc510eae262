"""`hetrain simulate`: predict a cluster that need not exist, from catalog facts and a model given by
preset or by parameters, FLOPs and activation bytes per sample. No processes: the fastest single
device, plain DDP with an equal split and hetrain's uneven split side by side, then every layout
ranked (planning/ranking.py)."""

from __future__ import annotations

import json
import math
from typing import Optional

import typer
from rich.table import Table

from ..console import console

from ..errors import UsageError
from ..hardware import catalog
from ..hardware.cluster import parse_cluster_spec
from ..hardware.units import MANY_DEVICES, by_kind, compact, device_kinds, format_bytes
from ..planning.cost import DEFAULT_EFFICIENCY, GRAD_ELEMENT_BYTES, fixed_bytes
from ..planning.memory import STATE_VALUES
from ..planning.presets import PRESETS
from ..planning.profile import ModelSpec
from ..planning.savers import DEFAULT_HOST_MEMORY_PER_NODE
from .model_options import check_common, check_offload_request, link_option, model_spec, saver_options
from .islands_show import bridged_link, has_islands
from .plan_show import topology_lines


def _list_gpus() -> None:
    t = Table(title="GPU catalog", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("name", "aliases", "bf16 TFLOPS", "fp32 TFLOPS", "memory", "speed index"):
        t.add_column(c)
    for g in catalog.all_gpus():
        t.add_row(g.key, ", ".join(g.aliases), f"{g.bf16_tflops:g}", f"{g.fp32_tflops:g}",
                  format_bytes(g.memory_bytes), f"{g.speed_index:g}")
    console().print(t)


def _list_presets() -> None:
    t = Table(title="model presets", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("preset", "params", "FLOPs/sample", "activations/sample", "assumptions"):
        t.add_column(c, overflow="fold")
    for name, m in PRESETS.items():
        t.add_row(name, f"{m.params / 1e6:,.1f}M", f"{m.flops_per_sample:.3g}",
                  format_bytes(m.activation_bytes_per_sample), m.assumptions)
    console().print(t)


def simulate(
    cluster: Optional[str] = typer.Option(None, "--cluster", help="devices, e.g. a100-80g,rtx3090 or "
                                          "a100-80g:1.0,rtx3090:0.67@12GiB, or nodes and links: "
                                          "'node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE' "
                                          "(the cluster spec grammar `hetrain run` takes)"),
    model: Optional[str] = typer.Option(None, "--model", help=f"a preset: {', '.join(PRESETS)}"),
    params: Optional[str] = typer.Option(None, "--params", help="the model's parameters, e.g. 124e6"),
    flops_per_sample: Optional[str] = typer.Option(None, "--flops-per-sample",
                                                   help="training FLOPs per sample (fwd+bwd), e.g. 8.8e11"),
    activation_bytes: Optional[str] = typer.Option(None, "--activation-bytes",
                                                   help="activation bytes per sample, e.g. 6.3e8 or 600MiB"),
    trainable_params: Optional[str] = typer.Option(None, "--trainable-params", help="fine-tuning: the "
                                                   "parameters that train (gradients, optimizer state), e.g. 13.6e6"),
    lora: Optional[int] = typer.Option(None, "--lora", help="fine-tuning a preset with LoRA of this rank "
                                       "on q,k,v,o of every layer, e.g. 16"),
    global_batch: int = typer.Option(256, "--global-batch", help="samples per optimizer step, all devices"),
    precision: str = typer.Option("bf16", "--precision", help="fp32 | bf16 | fp16"),
    efficiency: float = typer.Option(DEFAULT_EFFICIENCY, "--efficiency",
                                     help="fraction of the catalog peak reached (model FLOPs utilisation)"),
    ratios: str = typer.Option("spec", "--ratios", help="speed ratios between devices: 'spec' (the cluster "
                               "spec's speeds, i.e. the catalog speed index unless given) or 'peak' (peak FLOPS)"),
    link_gbs: Optional[float] = typer.Option(None, "--link-gbs", help="slowest link, GB/s (default: catalog PCIe/NVLink)"),
    optimizer: str = typer.Option("adamw", "--optimizer", help=f"optimizer state: {', '.join(STATE_VALUES)}"),
    memory_margin: float = typer.Option(0.10, "--memory-margin", help="fraction of memory kept free"),
    checkpointing: str = typer.Option("plan", "--checkpointing", help="activation checkpointing in the layouts: "
                                      "plan (the fewest blocks that fit, where one sample needs it) | none"),
    offload: str = typer.Option("plan", "--offload", help="optimizer state in host memory in the data-parallel "
                                "layouts: plan (smallest cards first, only where needed to fit) | all | none"),
    host_memory: Optional[str] = typer.Option(None, "--host-memory", help="host memory per node for offloaded "
                                              "optimizer state, e.g. 512GiB (default 256GiB per node)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object (strategies, devices, answers)"),
    list_gpus: bool = typer.Option(False, "--list-gpus", help="list the GPU catalog and exit"),
    list_presets: bool = typer.Option(False, "--list-presets", help="list the model presets and exit"),
) -> None:
    """Predict a mixed cluster without running anything: fastest device, plain DDP, hetrain, every layout.

    Answers "what does adding an RTX 3090 to my A100 buy me?", "which card is the bottleneck?" and
    "which layout (DP, ZeRO-1, capacity, FSDP2, PP, DP×PP, TP) fits, and which is fastest?".
    Compute comes from FLOPs per sample and the catalog (an estimate; `hetrain plan` measures).
    """
    from ..planning.simulate import cluster_profiles
    from ..planning.simulate import simulate as run_simulation

    if list_gpus or list_presets:
        if list_gpus:
            _list_gpus()
        if list_presets:
            _list_presets()
        return
    if not cluster:
        raise UsageError("no cluster given", "give devices, e.g. --cluster a100-80g,rtx3090 (--list-gpus lists names)")
    check_common(global_batch, precision, memory_margin)
    if checkpointing == "all":
        raise UsageError("--checkpointing all in simulate", "use plan (the fewest blocks that fit) or none")
    if not 0 < efficiency <= 1:
        raise UsageError(f"--efficiency {efficiency} is not a fraction", "give a fraction in (0, 1], e.g. 0.4")
    spec = model_spec(model, params, flops_per_sample, activation_bytes, trainable_params, lora)
    parsed = parse_cluster_spec(cluster)
    devices = parsed.devices
    grad_bytes = spec.trainable * GRAD_ELEMENT_BYTES     # only trainable parameters are synchronised
    topology = None
    if parsed.topology.named:
        from ..planning.topology import topology_sync

        if link_gbs is not None:
            raise UsageError("--link-gbs with a cluster spec that names its nodes and links",
                             "give the links in the spec (e.g. node0=2xa100-80g/12GB/s; net=25GbE), or drop --link-gbs")
        topology = topology_sync(parsed, grad_bytes)
    profiles = cluster_profiles(devices, spec, precision=precision, efficiency=efficiency, ratios=ratios,
                                optimizer=optimizer)
    link = topology.link if topology else link_option(link_gbs)
    if has_islands(parsed):      # every device's gradient crosses the bridge: the ranking's ring is as slow
        link = bridged_link(parsed, grad_bytes)
    savers = saver_options(offload, host_memory, checkpointing, nodes=len(parsed.topology.nodes) or 1,
                           default_host=DEFAULT_HOST_MEMORY_PER_NODE)
    ranking = _rank(profiles, spec, precision=precision, optimizer=optimizer, global_batch=global_batch,
                    grad_bytes=grad_bytes, link=link, memory_margin=memory_margin, savers=savers)
    try:
        sim = run_simulation(profiles, global_batch=global_batch, grad_bytes=grad_bytes, link=link,
                             memory_margin=memory_margin, allow_checkpointing=savers["allow_checkpointing"])
    except UsageError as e:     # plain data parallelism cannot run: the layouts say what can
        sim, dp_error = None, e
    net_lines, net_json = topology_lines(topology, sim, grad_bytes) if topology and sim else ([], None)
    from ..hardware.islands import describe_islands

    islands_line = describe_islands(parsed)
    islands = _islands(parsed, profiles, spec, precision=precision, global_batch=global_batch, grad_bytes=grad_bytes,
                       memory_margin=memory_margin, savers=savers)
    if json_out:
        out = {"cluster": cluster, "model": {"name": spec.name, "params": spec.params,
                                             "trainable_params": spec.trainable,
                                             "flops_per_sample": spec.flops_per_sample,
                                             "activation_bytes_per_sample": spec.activation_bytes_per_sample,
                                             "assumptions": spec.assumptions},
               "precision": precision, "efficiency": efficiency, "ratios": ratios,
               **(sim.to_dict() if sim else {"data_parallel_error": dp_error.what}),
               "layouts": ranking.to_dict() if ranking else None}
        if net_json is not None:
            out["topology"] = net_json
        if islands is not None:
            out["islands"] = {"found": islands_line, **islands[1]}
        elif islands_line:
            out["islands"] = {"found": islands_line}
        typer.echo(json.dumps(out, indent=2, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o))
        if ranking is not None and not any(r.fits for r in ranking.rows):
            raise typer.Exit(2)
        return
    where = cluster if len(cluster) <= 100 else (
        f"{len(devices)} devices ({device_kinds([d.label for d in devices], limit=0)})"
        + (f" on {len(parsed.topology.nodes)} nodes" if parsed.topology.named else ""))
    title = f"{spec.name} on {where}, global batch {global_batch}, {precision}"
    if islands_line:
        typer.echo(islands_line)
    if sim is not None:
        _show_simulation(sim, spec, profiles, title, net_lines, optimizer, precision)
    if ranking is not None:
        from .layouts_show import show_ranking

        show_ranking(ranking, title=f"every layout (simulated): {title}")
    for line in islands[0] if islands is not None else ():
        console().print(f"• {line}", markup=False)
    if ranking is not None:
        if not any(r.fits for r in ranking.rows):    # a row that fits but auto leaves out is said above
            raise UsageError("no layout fits memory on these devices", ranking.to_fit[0] if ranking.to_fit
                             else "use devices with more memory")
    elif sim is None:
        raise dp_error


def _islands(parsed, profiles, spec: ModelSpec, *, precision: str, global_batch: int, grad_bytes: float,
             memory_margin: float, savers: dict):
    """Device islands joined by a bridge: the three ways to train them (cli/islands_show.py), or None."""
    from .islands_show import island_report
    from ..planning.options import PlanOptions

    if not has_islands(parsed):
        return None
    options = PlanOptions(global_batch=global_batch, grad_bytes=grad_bytes, memory_margin=memory_margin,
                          allow_checkpointing=savers["allow_checkpointing"])
    return island_report(parsed, profiles, spec, options, precision=precision)


def _rank(profiles, spec: ModelSpec, *, precision: str, optimizer: str, global_batch: int, grad_bytes: float,
          link, memory_margin: float, savers: dict):
    """Every layout ranked, on two or more devices (one device runs data parallelism alone), its
    best what parallel='auto' of a default job would run (planning/chooser.py)."""
    if len(profiles) < 2:
        return None
    from ..planning.chooser import AUTO
    from ..planning.ranking import ModelState, rank_layouts
    from ..planning.options import PlanOptions

    state = ModelState.from_spec(spec, precision=precision, optimizer=optimizer)
    options = PlanOptions(global_batch=global_batch, grad_bytes=grad_bytes, link=link, memory_margin=memory_margin,
                          **savers)
    check_offload_request(state, options)
    return rank_layouts(profiles, state=state, options=options, request=AUTO)


def _show_simulation(sim, spec: ModelSpec, profiles, title: str, net_lines, optimizer: str, precision: str) -> None:
    from ..planning.simulate import describe_memory

    con = console()
    single = sim.strategies[0].samples_per_s
    t = Table(title=f"simulated (no processes, catalog estimates): {title}", title_justify="left",
              show_edge=False, pad_edge=False)
    for c in ("strategy", "samples/s", "× single", "efficiency", "memory per device"):
        t.add_column(c, overflow="fold")
    for s in sim.strategies:
        t.add_row(s.name, f"{s.samples_per_s:.1f}" if s.samples_per_s else "-",
                  f"{s.samples_per_s / single:.2f}" if single and s.samples_per_s else "-",
                  f"{s.efficiency:.0%}" if s.samples_per_s else "-",
                  compact([describe_memory(m) for m in s.memory_per_device], sep=", ", limit=MANY_DEVICES))
    con.print(t)
    con.print("efficiency: of the sum of every device's standalone samples/s", markup=False)
    for s in sim.strategies:
        con.print(f"  {s.name}: {s.why}", markup=False)
    d = Table(title="per device", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("device", "alone samples/s", "DDP share", "hetrain share", "adds", "note"):
        d.add_column(c, overflow="fold")
    for row, count in ((g[0], len(g)) for g in by_kind(sim.devices, label=lambda r: r.device, same=lambda r: (
            r.standalone_samples_per_s, r.ddp_share, r.hetrain_share, r.note))):
        d.add_row(row.device + (f" (and {count - 1} like it)" if count > 1 else ""),
                  f"{row.standalone_samples_per_s:.1f}", str(row.ddp_share or "-"), str(row.hetrain_share or "left out"),
                  "-" if row.adds_samples_per_s is None else f"{row.adds_samples_per_s:+.1f}/s", row.note)
    con.print(d)
    for line in [*sim.answers, *net_lines]:
        con.print(f"• {line}", markup=False)
    con.print(f"assumptions: {spec.assumptions}; compute: {profiles[0].source}; link: "
              f"{sim.link.bandwidth_gbs:.3g} GB/s ({sim.link.source}); optimizer {optimizer} "
              f"({fixed_bytes(1, optimizer)} bytes per trainable parameter"
              + (f", {fixed_bytes(1, optimizer, trainable=0, precision=precision)} per frozen one"
                 if spec.frozen else "") + ")", markup=False)
