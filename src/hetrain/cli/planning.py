"""`hetrain plan` and `hetrain simulate`.

plan      measures the user's model (a factory function: `module:function` or `script.py:function`
          returning (model, optimizer, dataset[, collate_fn])) on the devices present — or on an
          emulated cluster — and writes a Plan that `hetrain.init(plan="plan.json")` runs.
simulate  predicts, without processes, three strategies on a cluster spec from catalog facts and a
          model given by preset or by parameters, FLOPs and activation bytes per sample.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import UsageError
from ..hardware import catalog
from ..hardware.cluster import parse_cluster
from ..hardware.units import format_bytes, parse_bytes
from ..planning.collectives import Link
from ..planning.cost import DEFAULT_EFFICIENCY, GRAD_ELEMENT_BYTES, fixed_bytes
from ..planning.memory import STATE_VALUES
from ..planning.plan import Plan
from ..planning.presets import PRESETS, preset
from ..planning.profile import ModelSpec
from ..vocabulary import PRECISIONS, check_choice

# Gloo all-reduce between processes on one host (loopback), for `plan --emulate` (no processes
# are started to measure it; the runtime measures the real one when it plans for itself).
LOOPBACK_GBS = 1.0


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


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


def _check_common(global_batch: int, precision: str, memory_margin: float) -> None:
    _positive_int(global_batch, "--global-batch", "give the samples per optimizer step, e.g. --global-batch 256")
    check_choice(precision, PRECISIONS, "--precision")
    if not 0 <= memory_margin < 1:
        raise UsageError(f"--memory-margin {memory_margin}", "give the fraction of memory kept free, in [0, 1)")


def _model_spec(model: Optional[str], params: Optional[str], flops: Optional[str], act: Optional[str]) -> ModelSpec:
    if model and any(v is not None for v in (params, flops, act)):
        raise UsageError("--model and --params/--flops-per-sample/--activation-bytes both given",
                         "give a preset with --model, or the three numbers, not both")
    if model:
        return preset(model)
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
    return ModelSpec(name=f"{n / 1e6:.4g}M-parameter model", params=n,
                     flops_per_sample=_number(flops, "--flops-per-sample"),
                     activation_bytes_per_sample=_number(act, "--activation-bytes", allow_units=True),
                     assumptions="given on the command line")


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
                                          "a100-80g:1.0,rtx3090:0.67@12GiB (same grammar as --emulate)"),
    model: Optional[str] = typer.Option(None, "--model", help=f"a preset: {', '.join(PRESETS)}"),
    params: Optional[str] = typer.Option(None, "--params", help="trainable parameters, e.g. 124e6"),
    flops_per_sample: Optional[str] = typer.Option(None, "--flops-per-sample",
                                                   help="training FLOPs per sample (fwd+bwd), e.g. 8.8e11"),
    activation_bytes: Optional[str] = typer.Option(None, "--activation-bytes",
                                                   help="activation bytes per sample, e.g. 6.3e8 or 600MiB"),
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
    spec = _model_spec(model, params, flops_per_sample, activation_bytes)
    devices = parse_cluster(cluster)
    profiles = cluster_profiles(devices, spec, precision=precision, efficiency=efficiency, ratios=ratios,
                                optimizer=optimizer)
    sim = run_simulation(profiles, global_batch=global_batch, grad_bytes=spec.params * GRAD_ELEMENT_BYTES,
                         link=_link(link_gbs), memory_margin=memory_margin)
    if json_out:
        out = {"cluster": cluster, "model": {"name": spec.name, "params": spec.params,
                                             "flops_per_sample": spec.flops_per_sample,
                                             "activation_bytes_per_sample": spec.activation_bytes_per_sample,
                                             "assumptions": spec.assumptions},
               "precision": precision, "efficiency": efficiency, "ratios": ratios, **sim.to_dict()}
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
    for line in sim.answers:
        con.print(f"• {line}", markup=False)
    con.print(f"assumptions: {spec.assumptions}; compute: {profiles[0].source}; link: "
              f"{sim.link.bandwidth_gbs:.3g} GB/s ({sim.link.source}); optimizer {optimizer} "
              f"({fixed_bytes(1, optimizer)} bytes/parameter)", markup=False)


# -- plan -------------------------------------------------------------------------------------
def _load_factory(spec: str):
    """'pkg.module:function' or 'path/to/script.py:function' -> the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise UsageError(f"--model-factory {spec!r} is not MODULE:FUNCTION or SCRIPT.py:FUNCTION",
                         "e.g. --model-factory train.py:make or --model-factory mypkg.models:make")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UsageError(f"--model-factory: {target!r} does not exist", "check the path to your script")
            sys.path.insert(0, str(path.resolve().parent))
            mod_spec = importlib.util.spec_from_file_location(f"_hetrain_factory_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)     # `if __name__ == "__main__":` keeps training out
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise UsageError(f"--model-factory: cannot import {target!r}: {e}",
                         "check the module name and PYTHONPATH, or give a script path") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"--model-factory: {target!r} has no function {name!r}",
                         "define it: def make(): return model, optimizer, dataset")
    return fn


def _call_factory(fn, spec: str):
    import torch

    made = fn()
    if not isinstance(made, (tuple, list)) or len(made) not in (3, 4):
        raise UsageError(f"--model-factory {spec!r} returned {type(made).__name__}",
                         "return (model, optimizer, dataset) or (model, optimizer, dataset, collate_fn)")
    model, opt, dataset = made[:3]
    if not isinstance(model, torch.nn.Module) or not isinstance(opt, torch.optim.Optimizer):
        raise UsageError(f"--model-factory {spec!r}: expected (nn.Module, Optimizer, dataset, …), got "
                         f"({type(model).__name__}, {type(opt).__name__}, …)",
                         "return (model, optimizer, dataset) as you would pass them to ht.prepare")
    if not hasattr(dataset, "__len__") or len(dataset) < 1:
        raise UsageError(f"--model-factory {spec!r}: the dataset is empty or has no length",
                         "return a map-style dataset with at least one sample")
    collate = made[3] if len(made) == 4 else None
    return model, opt, dataset, collate


def plan(
    model_factory: Optional[str] = typer.Option(None, "--model-factory", help="MODULE:FUNCTION or "
                                                "SCRIPT.py:FUNCTION returning (model, optimizer, dataset"
                                                "[, collate_fn]) — measured on each device"),
    model: Optional[str] = typer.Option(None, "--model", help="or a preset (catalog estimate, no measuring)"),
    params: Optional[str] = typer.Option(None, "--params", help="or the model's parameters (with the next two)"),
    flops_per_sample: Optional[str] = typer.Option(None, "--flops-per-sample", help="training FLOPs per sample"),
    activation_bytes: Optional[str] = typer.Option(None, "--activation-bytes", help="activation bytes per sample"),
    emulate: Optional[str] = typer.Option(None, "--emulate", help="plan for an emulated cluster, e.g. "
                                          "a100-80g,rtx3090 (default: the GPUs present, else this CPU)"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch",
                                               help="samples per optimizer step, all devices (required)"),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | bf16 | fp16 (as the job's init)"),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="cap on every micro-batch"),
    memory_margin: float = typer.Option(0.10, "--memory-margin", help="fraction of memory kept free"),
    link_gbs: Optional[float] = typer.Option(None, "--link-gbs", help="slowest link, GB/s"),
    allow_exclusion: bool = typer.Option(False, "--allow-exclusion", help="let the plan leave out devices "
                                         "too slow to help (then launch without them)"),
    out: Optional[str] = typer.Option(None, "--out", help="write the plan here (hetrain.init(plan=PATH) runs it)"),
    json_out: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    blocks: Optional[int] = typer.Option(None, "--blocks", help="blocks (layers) a pipeline could cut between, "
                                         "to compare DP, PP and DP×PP (default: from the model or preset)"),
) -> None:
    """Plan a job: each device's share, micro-batches and predicted throughput, with the reasons.

    With --model-factory the model is measured on each device (cached by model and device); with
    --model/--params it is estimated from the catalog. Every device takes part unless
    --allow-exclusion; the written plan runs with hetrain.init(global_batch=N, plan="plan.json").
    """
    from ..planning.planner import PlanOptions, make_plan

    if global_batch is None:
        raise UsageError("no --global-batch given", "give the samples per optimizer step over all devices, "
                         "as in hetrain.init(global_batch=N), e.g. --global-batch 64")
    _check_common(global_batch, precision, memory_margin)
    if micro_batch is not None:
        _positive_int(micro_batch, "--micro-batch", "give a positive cap, or leave it out")
    if model_factory and (model or params):
        raise UsageError("--model-factory and a --model/--params estimate both given", "give one of them")
    link = _link(link_gbs)
    cluster = parse_cluster(emulate) if emulate else None
    host_cores = None
    if blocks is not None:
        _positive_int(blocks, "--blocks", "give the number of layers the model stacks")
    if model_factory:
        profiles, grad_bytes, default_link, found = _measure_factory(model_factory, cluster, precision, global_batch)
        blocks = blocks or found
        if cluster is not None:
            host_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    else:
        spec = _model_spec(model, params, flops_per_sample, activation_bytes)
        blocks = blocks or spec.blocks
        profiles, default_link = _estimate(spec, cluster, precision)
        grad_bytes = spec.params * GRAD_ELEMENT_BYTES
    options = PlanOptions(global_batch=global_batch, grad_bytes=grad_bytes, link=link or default_link,
                          memory_margin=memory_margin, micro_batch_cap=micro_batch,
                          allow_exclusion=allow_exclusion, allow_checkpointing=False, host_cores=host_cores)
    try:
        result = make_plan(profiles, options)
    except UsageError as e:
        if len(profiles) > 1 and all(p.memory_bytes for p in profiles):
            fix = _show_sharding(profiles, grad_bytes, memory_margin)
            _show_layouts(profiles, blocks, grad_bytes, global_batch, link or default_link, memory_margin)
            if fix:
                raise UsageError(e.what, fix) from None
        raise
    if out:
        Path(out).write_text(result.to_json())
    if json_out:
        typer.echo(result.to_json())
        return
    _show_plan(result, out, emulate, cluster)
    _show_layouts(profiles, blocks, grad_bytes, global_batch, link or default_link, memory_margin)


def _show_sharding(profiles, grad_bytes: int, margin: float) -> str | None:
    """When the model state does not fit plain data parallelism: memory per device under each
    sharding (planning/memory.py), and the one the runtime's sharding='auto' would take."""
    from ..planning.memory import DeviceMemory, choose_sharding, sharding_options

    devices = [DeviceMemory(label=p.device, capacity=p.memory_bytes * (1 - margin),
                            activations=p.activation_fixed_bytes + p.activation_bytes_per_sample) for p in profiles]
    options = sharding_options(max(1, grad_bytes // GRAD_ELEMENT_BYTES), devices)   # parameters
    con = _console()
    t = Table(title="memory per device by sharding (model state + one sample's activations)",
              title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("sharding")
    for d in devices:
        t.add_column(f"{d.label} ({format_bytes(d.capacity)} usable)", overflow="fold")
    t.add_column("fits")
    for o in options:
        t.add_row(o.strategy, *(format_bytes(b) for b in o.peak), "yes" if o.fits(devices) else "no")
    con.print(t)
    try:
        option, why = choose_sharding(options, devices)
    except UsageError:
        return None
    return (f"shard it: hetrain.init(sharding={option.strategy!r}) fits ({why}); the default sharding='auto' "
            "chooses it at run time")


def _show_layouts(profiles, blocks: int | None, grad_bytes: int, global_batch: int, link, margin: float) -> None:
    """Data parallelism against pipelines and DP×PP for these devices (planning/parallelism.py),
    the choice with its reason. Blocks are taken as equal, from the whole-model profile."""
    from ..planning.parallelism import compare_parallelism
    from ..planning.pipeline_split import PipelineProfile, StageDevice

    con = _console()
    if len(profiles) < 2:
        return
    if not blocks:
        con.print("  parallelism: data parallel (pipelines not compared: the model's block count is "
                  "unknown; pass --blocks N)", markup=False)
        return
    fastest = min(profiles, key=lambda p: p.per_sample_s)
    layer = PipelineProfile.uniform(
        n_blocks=blocks, seconds_per_sample=fastest.per_sample_s,
        activation_bytes_per_sample=fastest.activation_bytes_per_sample, param_bytes=grad_bytes,
        source=f"{blocks} equal blocks from {fastest.device}'s whole-model profile")
    devices = [StageDevice(name=p.device, speed=fastest.per_sample_s / p.per_sample_s, memory_bytes=p.memory_bytes)
               for p in profiles]
    try:
        choice = compare_parallelism(layer, devices, global_batch=global_batch, memory_margin=margin, link=link)
    except UsageError as e:
        con.print(f"  parallelism: {e.what}; {e.fix}", markup=False)
        return
    for line in choice.describe():
        con.print(line, markup=False)


def _measure_factory(spec: str, cluster, precision: str, global_batch: int):
    import torch
    from torch.utils.data import default_collate

    from ..runtime.probe import default_forward
    from ..runtime.profiler import MAX_SIZE, profile_device
    from ..runtime.data import to_device
    from ..planning.cost import catalog_link

    fn = _load_factory(spec)
    model, opt, dataset, collate = _call_factory(fn, spec)
    collate = collate or default_collate
    n = len(dataset)

    def loader(device):
        def load(m):
            items = [dataset[i] for i in range(min(m, n))]
            batch = collate(items)
            return to_device(batch, device)
        return load

    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    max_size = max(1, min(MAX_SIZE, global_batch, n))
    try:
        from ..parallel.blocks import find_parts

        found = len(find_parts(model).blocks)
    except UsageError:
        found = None
    con = Console(stderr=True, highlight=False, soft_wrap=True)     # stdout stays the plan (--json)
    if cluster is not None:
        torch.set_num_threads(1)           # one emulated device = one CPU thread
        cpu = torch.device("cpu")
        profiles = []
        for d in cluster:
            p, cached = profile_device(model, opt, loader(cpu), device=cpu, label=d.label, forward=default_forward,
                                       precision=precision, max_size=max_size, emulate=d)
            profiles.append(p)
        con.print(f"profiled on this CPU ({'cached' if cached else 'measured'}), converted to each emulated speed",
                  markup=False)
        return profiles, grad_bytes, Link(bandwidth_gbs=LOOPBACK_GBS, source="gloo on loopback (emulation)"), found
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        profiles, gpus = [], []
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            model.to(dev)
            for state in opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.to(dev)
            name = torch.cuda.get_device_name(dev)
            cap = torch.cuda.get_device_properties(dev).total_memory
            p, cached = profile_device(model, opt, loader(dev), device=dev, label=f"cuda:{i} {name}",
                                       forward=default_forward, precision=precision, memory_bytes=cap,
                                       max_size=max_size)
            profiles.append(p)
            gpus.append(catalog.lookup(name))
            con.print(f"cuda:{i} {name}: {'from the cache' if cached else 'measured'}", markup=False)
        model.to("cpu")
        known = [g for g in gpus if g is not None]
        link = catalog_link(known) if len(known) == len(gpus) else None
        return profiles, grad_bytes, link, found
    cpu = torch.device("cpu")
    p, cached = profile_device(model, opt, loader(cpu), device=cpu, label="cpu", forward=default_forward,
                               precision=precision, max_size=max_size)
    return [p], grad_bytes, None, found




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


def _show_plan(result: Plan, out: Optional[str], emulate: Optional[str], cluster) -> None:
    con = _console()
    t = Table(title=f"plan: global batch {result.global_batch} over {result.world_size} device(s)",
              title_justify="left", show_edge=False, pad_edge=False)
    for c in ("rank", "device", "share", "micro-batch", "precision", "checkpointing", "compute/step", "memory"):
        t.add_column(c, overflow="fold")
    for d in result.devices:
        t.add_row(str(d.rank), d.device, str(d.share), f"{d.micro_batch} x{d.n_micro}", d.precision,
                  "on" if d.checkpointing else "off",
                  f"{(d.predicted_compute_s or 0) * 1e3:.1f} ms",
                  format_bytes(d.predicted_memory_bytes) if d.predicted_memory_bytes else "-")
    con.print(t)
    for d in result.devices:
        for r in d.reasons:
            con.print(f"  rank {d.rank}: {r}", markup=False)
    for line in filter(None, result.note.split("; ")):
        con.print(f"  {line}", markup=False)
    for e in result.excluded:
        con.print(f"  left out {e.device}: {e.reason}; {e.fix}", markup=False)
    if result.excluded and cluster is not None:
        kept = [d for d in cluster if any(p.device.split(" ")[0] == d.label for p in result.devices)]
        spec = ",".join(f"{d.gpu.key}:{d.speed:g}@{d.memory_bytes}B" for d in kept)
        con.print(f"  launch it on the devices kept: hetrain run --emulate {spec} …", markup=False)
    if out:
        con.print(f"wrote {out}: run it with hetrain.init(global_batch={result.global_batch}, plan={out!r})"
                  + (f" under `hetrain run --emulate {emulate} …`" if emulate and not result.excluded else ""),
                  markup=False)


def register(app: typer.Typer) -> None:
    app.command()(plan)
    app.command()(simulate)
