"""`hetrain plan` and `hetrain simulate`.

plan      measures the user's model (a factory function: `module:function` or `script.py:function`
          returning (model, optimizer, dataset[, collate_fn])) in the job's own processes on the
          devices present — or on an emulated cluster — as the runtime does, and writes the Plan
          the runtime would make from those measurements (`hetrain.init(plan="plan.json")` runs it);
          or estimates one from the catalog for a preset or given numbers.
simulate  predicts, without processes, three strategies on a cluster spec from catalog facts and a
          model given by preset or by parameters, FLOPs and activation bytes per sample.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import UsageError
from ..files import check_writable, write_json_atomic, write_text_atomic
from ..hardware import catalog
from ..hardware.cluster import parse_cluster, parse_cluster_spec
from ..hardware.units import format_bytes, parse_bytes
from ..planning.collectives import Link
from ..planning.cost import DEFAULT_EFFICIENCY, GRAD_ELEMENT_BYTES, fixed_bytes
from ..planning.memory import STATE_VALUES
from ..planning.presets import PRESETS, fine_tuned
from ..planning.profile import ModelSpec
from ..runtime.config import Config
from ..vocabulary import CHECKPOINTINGS, PRECISION_REQUESTS, PRECISIONS, check_choice
from .plan_show import show_layouts, show_plan, show_sharding, topology_lines

def _console() -> Console:
    from ..console import console      # wide off a terminal: one table row per line in logs

    return console()


def _number(text: str, what: str, *, integer: bool = False, allow_units: bool = False) -> float:
    """'124e6', '1.2e12', '600MiB' (with allow_units) -> a positive number; else a UsageError."""
    try:
        value = float(text)
    except ValueError:
        if allow_units:
            return float(parse_bytes(text, what=what))
        raise UsageError(f"{what} {text!r} is not a number", f"give a positive number, e.g. {what} 1.2e9") from None
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{what} {text!r} must be a positive number", f"give a positive number for {what}")
    if integer and value != int(value):
        raise UsageError(f"{what} {text!r} must be a whole number", f"give a whole number for {what}")
    return int(value) if integer else value


def _positive_int(value: int, what: str, fix: str) -> int:
    if value < 1:
        raise UsageError(f"{what} {value} must be at least 1", fix)
    return value


def _check_common(global_batch: int, precision: str, memory_margin: float, *, precisions=PRECISIONS) -> None:
    _positive_int(global_batch, "--global-batch", "give the samples per optimizer step, e.g. --global-batch 256")
    check_choice(precision, precisions, "--precision")
    if not 0 <= memory_margin < 1:
        raise UsageError(f"--memory-margin {memory_margin}", "give the fraction of memory kept free, in [0, 1)")


def _model_spec(model: Optional[str], params: Optional[str], flops: Optional[str], act: Optional[str],
                trainable: Optional[str] = None, lora: Optional[int] = None) -> ModelSpec:
    if model and any(v is not None for v in (params, flops, act)):
        raise UsageError("--model and --params/--flops-per-sample/--activation-bytes both given",
                         "give a preset with --model, or the three numbers, not both")
    n_trainable = None if trainable is None else int(_number(trainable, "--trainable-params", integer=True))
    if model:
        return fine_tuned(model, trainable=n_trainable, lora_rank=lora)
    if lora is not None:
        raise UsageError(f"--lora {lora} needs a model preset (it sizes the adapters from the preset's layers)",
                         "for a model given by --params, give its trainable parameters with --trainable-params N "
                         "(LoRA of rank r adds r·(in+out) per adapted in→out linear)")
    if params is None:
        raise UsageError("no model given",
                         f"give --model PRESET ({', '.join(PRESETS)}) or --params, --flops-per-sample "
                         "and --activation-bytes")
    n = int(_number(params, "--params", integer=True))
    if flops is None or act is None:
        missing = " and ".join(f for f, v in (("--flops-per-sample", flops), ("--activation-bytes", act)) if v is None)
        raise UsageError(f"--params given without {missing}",
                         "give all three, e.g. --params 124e6 --flops-per-sample 8.8e11 --activation-bytes 600MiB "
                         "(a transformer's FLOPs per sample ≈ 6 · params · tokens)")
    if n_trainable is not None and n_trainable > n:
        raise UsageError(f"--trainable-params {trainable} is more than --params {params}",
                         "give at most the model's parameters (all of them train: leave --trainable-params out)")
    return ModelSpec(name=f"{n / 1e6:.4g}M-parameter model", params=n, trainable_params=n_trainable,
                     flops_per_sample=_number(flops, "--flops-per-sample"),
                     activation_bytes_per_sample=_number(act, "--activation-bytes", allow_units=True),
                     assumptions="given on the command line" + (
                         f"; fine-tuning {n_trainable:,} trainable parameters, the frozen rest at the "
                         "training precision" if n_trainable is not None else ""))


def _link(link_gbs: Optional[float]) -> Link | None:
    if link_gbs is None:
        return None
    if not link_gbs > 0:
        raise UsageError(f"--link-gbs {link_gbs} must be positive", "give the slowest link's bandwidth in GB/s, e.g. 24")
    return Link(bandwidth_gbs=link_gbs, source="given with --link-gbs")


def _list_gpus() -> None:
    t = Table(title="GPU catalog", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("name", "aliases", "bf16 TFLOPS", "fp32 TFLOPS", "memory", "speed index"):
        t.add_column(c)
    for g in catalog.all_gpus():
        t.add_row(g.key, ", ".join(g.aliases), f"{g.bf16_tflops:g}", f"{g.fp32_tflops:g}",
                  format_bytes(g.memory_bytes), f"{g.speed_index:g}")
    _console().print(t)


def _list_presets() -> None:
    t = Table(title="model presets", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("preset", "params", "FLOPs/sample", "activations/sample", "assumptions"):
        t.add_column(c, overflow="fold")
    for name, m in PRESETS.items():
        t.add_row(name, f"{m.params / 1e6:,.1f}M", f"{m.flops_per_sample:.3g}",
                  format_bytes(m.activation_bytes_per_sample), m.assumptions)
    _console().print(t)


# -- simulate ---------------------------------------------------------------------------------
def simulate(
    cluster: Optional[str] = typer.Option(None, "--cluster", help="devices, e.g. a100-80g,rtx3090 or "
                                          "a100-80g:1.0,rtx3090:0.67@12GiB, or nodes and links: "
                                          "'node0=2xa100-80g/nvlink; node1=4xrtx3090/pcie4; net=25GbE' "
                                          "(same grammar as --emulate)"),
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
    json_out: bool = typer.Option(False, "--json", help="print one JSON object (strategies, devices, answers)"),
    list_gpus: bool = typer.Option(False, "--list-gpus", help="list the GPU catalog and exit"),
    list_presets: bool = typer.Option(False, "--list-presets", help="list the model presets and exit"),
) -> None:
    """Predict a mixed cluster without running anything: fastest single device vs plain DDP vs hetrain.

    Answers "what does adding an RTX 3090 to my A100 buy me?" and "which card is the bottleneck?".
    Compute comes from FLOPs per sample and the catalog (an estimate; `hetrain plan` measures).
    """
    from ..planning.simulate import cluster_profiles, describe_memory
    from ..planning.simulate import simulate as run_simulation

    if list_gpus or list_presets:
        if list_gpus:
            _list_gpus()
        if list_presets:
            _list_presets()
        return
    if not cluster:
        raise UsageError("no cluster given", "give devices, e.g. --cluster a100-80g,rtx3090 (--list-gpus lists names)")
    _check_common(global_batch, precision, memory_margin)
    if not 0 < efficiency <= 1:
        raise UsageError(f"--efficiency {efficiency} is not a fraction", "give a fraction in (0, 1], e.g. 0.4")
    spec = _model_spec(model, params, flops_per_sample, activation_bytes, trainable_params, lora)
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
    sim = run_simulation(profiles, global_batch=global_batch, grad_bytes=grad_bytes,
                         link=topology.link if topology else _link(link_gbs), memory_margin=memory_margin)
    net_lines, net_json = topology_lines(topology, sim, grad_bytes) if topology else ([], None)
    if json_out:
        out = {"cluster": cluster, "model": {"name": spec.name, "params": spec.params,
                                             "trainable_params": spec.trainable,
                                             "flops_per_sample": spec.flops_per_sample,
                                             "activation_bytes_per_sample": spec.activation_bytes_per_sample,
                                             "assumptions": spec.assumptions},
               "precision": precision, "efficiency": efficiency, "ratios": ratios, **sim.to_dict()}
        if net_json is not None:
            out["topology"] = net_json
        typer.echo(json.dumps(out, indent=2, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o))
        return

    con = _console()
    single = sim.strategies[0].samples_per_s
    t = Table(title=f"simulated (no processes, catalog estimates): {spec.name} on {cluster}, global batch "
              f"{global_batch}, {precision}", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("strategy", "samples/s", "× single", "efficiency", "memory per device"):
        t.add_column(c, overflow="fold")
    for s in sim.strategies:
        t.add_row(s.name, f"{s.samples_per_s:.1f}" if s.samples_per_s else "-",
                  f"{s.samples_per_s / single:.2f}" if single and s.samples_per_s else "-",
                  f"{s.efficiency:.0%}" if s.samples_per_s else "-",
                  ", ".join(describe_memory(m) for m in s.memory_per_device))
    con.print(t)
    con.print("efficiency: of the sum of every device's standalone samples/s", markup=False)
    for s in sim.strategies:
        con.print(f"  {s.name}: {s.why}", markup=False)
    d = Table(title="per device", title_justify="left", show_edge=False, pad_edge=False)
    for c in ("device", "alone samples/s", "DDP share", "hetrain share", "adds", "note"):
        d.add_column(c, overflow="fold")
    for row in sim.devices:
        d.add_row(row.device, f"{row.standalone_samples_per_s:.1f}", str(row.ddp_share or "-"),
                  str(row.hetrain_share or "left out"),
                  "-" if row.adds_samples_per_s is None else f"{row.adds_samples_per_s:+.1f}/s", row.note)
    con.print(d)
    for line in [*sim.answers, *net_lines]:
        con.print(f"• {line}", markup=False)
    con.print(f"assumptions: {spec.assumptions}; compute: {profiles[0].source}; link: "
              f"{sim.link.bandwidth_gbs:.3g} GB/s ({sim.link.source}); optimizer {optimizer} "
              f"({fixed_bytes(1, optimizer)} bytes per trainable parameter"
              + (f", {fixed_bytes(1, optimizer, trainable=0, precision=precision)} per frozen one"
                 if spec.frozen else "") + ")", markup=False)


# -- plan -------------------------------------------------------------------------------------
def plan(
    model_factory: Optional[str] = typer.Option(None, "--model-factory", help="MODULE:FUNCTION or "
                                                "SCRIPT.py:FUNCTION returning (model, optimizer, dataset"
                                                "[, collate_fn]) — measured on each device, as the runtime does"),
    model: Optional[str] = typer.Option(None, "--model", help="or a preset (catalog estimate, no measuring)"),
    params: Optional[str] = typer.Option(None, "--params", help="or the model's parameters (with the next two)"),
    flops_per_sample: Optional[str] = typer.Option(None, "--flops-per-sample", help="training FLOPs per sample"),
    activation_bytes: Optional[str] = typer.Option(None, "--activation-bytes", help="activation bytes per sample"),
    trainable_params: Optional[str] = typer.Option(None, "--trainable-params", help="fine-tuning: the "
                                                   "parameters that train (gradients, optimizer state), e.g. 13.6e6"),
    lora: Optional[int] = typer.Option(None, "--lora", help="fine-tuning a preset with LoRA of this rank "
                                       "on q,k,v,o of every layer, e.g. 16"),
    emulate: Optional[str] = typer.Option(None, "--emulate", help="plan for an emulated cluster, e.g. "
                                          "a100-80g,rtx3090 (default: the GPUs present, else this CPU)"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch",
                                               help="samples per optimizer step, all devices (required)"),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | bf16 | fp16, or auto with "
                                  "--model-factory (as the job's init)"),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="cap on every micro-batch"),
    memory_margin: float = typer.Option(0.10, "--memory-margin", help="fraction of memory kept free"),
    checkpointing: str = typer.Option("plan", "--checkpointing", help="activation checkpointing, as the "
                                      "job's init: plan (where one sample needs it) | all | none"),
    link_gbs: Optional[float] = typer.Option(None, "--link-gbs", help="slowest link, GB/s (replaces the "
                                             "measured or catalog one)"),
    allow_exclusion: bool = typer.Option(False, "--allow-exclusion", help="let the plan leave out devices "
                                         "too slow to help (then launch without them)"),
    out: Optional[str] = typer.Option(None, "--out", help="write the plan here (hetrain.init(plan=PATH) runs it)"),
    measurements: Optional[str] = typer.Option(None, "--measurements", help="with --model-factory: also write "
                                               "what the ranks measured, the plan's input, here (JSON)"),
    json_out: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    blocks: Optional[int] = typer.Option(None, "--blocks", help="blocks (layers) a pipeline could cut between, "
                                         "to compare DP, PP and DP×PP (default: from the model or preset)"),
) -> None:
    """Plan a job: each device's share, micro-batches and predicted throughput, with the reasons.

    With --model-factory the job's processes are started as `hetrain run` starts them and measure
    the model as the runtime does before training (profiles cached by model and device); the plan
    is the one the runtime would make from those measurements. With --model/--params it is
    estimated from the catalog. Every device takes part unless --allow-exclusion; the written plan
    runs with hetrain.init(global_batch=N, plan="plan.json").
    """
    from ..planning.planner import make_plan
    from ..runtime.measure.measurements import plan_options

    if global_batch is None:
        raise UsageError("no --global-batch given", "give the samples per optimizer step over all devices, "
                         "as in hetrain.init(global_batch=N), e.g. --global-batch 64")
    _check_common(global_batch, precision, memory_margin,
                  precisions=PRECISION_REQUESTS if model_factory else PRECISIONS)
    check_choice(checkpointing, CHECKPOINTINGS, "--checkpointing")
    if micro_batch is not None:
        _positive_int(micro_batch, "--micro-batch", "give a positive cap, or leave it out")
    if model_factory and (model or params):
        raise UsageError("--model-factory and a --model/--params estimate both given", "give one of them")
    if model_factory and (trainable_params or lora is not None):
        raise UsageError("--trainable-params/--lora with --model-factory", "the factory's model says what "
                         "trains (parameters with requires_grad): drop them, or freeze in the factory")
    if measurements and not model_factory:
        raise UsageError("--measurements without --model-factory", "an estimate measures nothing: drop it")
    link = _link(link_gbs)
    cluster = parse_cluster(emulate) if emulate is not None else None     # '' is a bad spec
    if blocks is not None:
        _positive_int(blocks, "--blocks", "give the number of layers the model stacks")
    for path, flag in ((out, "--out"), (measurements, "--measurements")):
        if path:
            check_writable(path, flag)          # before measuring, not after it
    config = Config(global_batch=global_batch, precision=precision, micro_batch=micro_batch,
                    memory_margin=memory_margin, checkpointing=checkpointing, emulate=emulate)
    if model_factory:
        from ..runtime.measure.measurements import options_from_measurements, plan_from_measurements, planning_profiles

        measured, config, found = _measure_in_job(model_factory, config)
        blocks = blocks or found
        grad_bytes, profiles = measured.grad_bytes, list(planning_profiles(measured, config))
        used_link = options_from_measurements(measured, config, link=link).link
        if measurements:
            write_text_atomic(measurements, measured.to_json())

        def make():
            return plan_from_measurements(measured, config, allow_exclusion=allow_exclusion, link=link)[0]
    else:
        spec = _model_spec(model, params, flops_per_sample, activation_bytes, trainable_params, lora)
        blocks = blocks or spec.blocks
        profiles, default_link = _estimate(spec, cluster, precision)
        grad_bytes, used_link = spec.trainable * GRAD_ELEMENT_BYTES, link or default_link

        def make():
            return make_plan(profiles, plan_options(config, grad_bytes=grad_bytes, link=used_link,
                                                    allow_exclusion=allow_exclusion))
    try:
        result = make()
    except UsageError as e:
        if len(profiles) > 1 and all(p.memory_bytes for p in profiles):
            fix = show_sharding(profiles, grad_bytes, memory_margin)
            show_layouts(profiles, blocks, grad_bytes, global_batch, used_link, memory_margin)
            if fix:
                raise UsageError(e.what, fix) from None
        raise
    if out:
        write_text_atomic(out, result.to_json())
    if json_out:
        typer.echo(result.to_json())
        return
    show_plan(result, out, emulate, cluster)
    show_layouts(profiles, blocks, grad_bytes, global_batch, used_link, memory_margin)


def _measure_in_job(factory: str, config: Config):
    """The runtime's own measurements of the factory's model, taken in the job's processes
    (cli/plan_worker.py under the launcher `hetrain run` uses). Returns the measurements, the
    config the ranks ran with, and the model's block count (None: not known)."""
    from ..launch import build_launch, run_launch
    from ..runtime.measure.factory import absolute, load_factory
    from ..runtime.measure.measurements import Measurements

    load_factory(factory)       # a bad spec or a missing function: one line now, before any process
    with tempfile.TemporaryDirectory(prefix="hetrain-plan-") as run_dir:
        job, result = os.path.join(run_dir, "job.json"), os.path.join(run_dir, "measured.json")
        write_json_atomic(job, {"factory": absolute(factory), "config": config.to_dict(), "out": result})
        launch = build_launch(target="hetrain.cli.plan_worker", target_args=(job,), module=True,
                              emulate=config.emulate, run_dir=run_dir)
        typer.echo(launch.describe(), err=True)
        code = run_launch(launch)
        if code:
            raise typer.Exit(code)      # the workers' error, printed once by the launcher
        with open(result) as f:
            measured = json.load(f)
    return Measurements.from_dict(measured["measurements"]), Config(**measured["config"]), measured["blocks"]


def _estimate(spec: ModelSpec, cluster, precision: str):
    from ..planning.cost import catalog_link
    from ..planning.simulate import cluster_profiles

    if cluster is None:
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
        if not names:
            raise UsageError("no GPU here to estimate for", "give --emulate SPEC for a cluster, or use "
                             "`hetrain simulate --cluster SPEC`; --model-factory measures this CPU")
        cluster = parse_cluster(",".join(catalog.resolve(n).key for n in names))
    return cluster_profiles(cluster, spec, precision=precision), catalog_link([d.gpu for d in cluster])


def register(app: typer.Typer) -> None:
    app.command()(plan)
    app.command()(simulate)
