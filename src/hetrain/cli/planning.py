"""`hetrain plan` and `hetrain simulate`.

`hetrain simulate` is in cli/simulate.py.

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
import os
import tempfile
from dataclasses import replace
from typing import Optional

import typer

from ..emulation import cli as emulation_cli
from ..errors import UsageError
from ..files import check_writable, write_json_atomic, write_text_atomic
from ..hardware import catalog
from ..hardware.cluster import parse_cluster
from ..planning.cost import GRAD_ELEMENT_BYTES
from ..planning.ranking import ModelState, rank_layouts
from ..planning.profile import ModelSpec
from ..runtime.config import Config, Emulation, Memory, make_config
from ..vocabulary import CHECKPOINTINGS, PRECISION_REQUESTS, PRECISIONS, check_choice
from .model_options import check_common, check_offload_request, link_option, model_spec, positive_int, saver_options
from .layouts_show import show_ranking
from .plan_show import show_plan


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
    emulate: Optional[str] = emulation_cli.option("plan for an emulated cluster, e.g. "
                                                  "a100-80g,rtx3090 (default: the GPUs present, else this CPU)"),
    global_batch: Optional[int] = typer.Option(None, "--global-batch",
                                               help="samples per optimizer step, all devices (required)"),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | bf16 | fp16, or auto with "
                                  "--model-factory (as the job's init)"),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="cap on every micro-batch"),
    memory_margin: float = typer.Option(0.10, "--memory-margin", help="fraction of memory kept free"),
    checkpointing: str = typer.Option("plan", "--checkpointing", help="activation checkpointing, as the "
                                      "job's init: plan (where one sample needs it) | all | none"),
    offload: str = typer.Option("plan", "--offload", help="optimizer state in host memory in the data-parallel "
                                "layouts: plan (smallest cards first, only where needed to fit) | all | none"),
    host_memory: Optional[str] = typer.Option(None, "--host-memory", help="host memory for offloaded optimizer "
                                              "state, e.g. 512GiB (default: with --model this host's available "
                                              "memory; with --model-factory none, as parallel='auto')"),
    link_gbs: Optional[float] = typer.Option(None, "--link-gbs", help="slowest link, GB/s (replaces the "
                                             "measured or catalog one)"),
    oom_recovery: bool = typer.Option(True, "--oom-recovery/--no-oom-recovery", help="as the job's "
                                      "Memory(oom_recovery=...): off, the recommendation may be capacity-full or TP"),
    allow_exclusion: bool = typer.Option(False, "--allow-exclusion", help="let the plan leave out devices "
                                         "too slow to help (then launch without them)"),
    out: Optional[str] = typer.Option(None, "--out", help="write the plan here (hetrain.init(plan=PATH) runs it)"),
    measurements: Optional[str] = typer.Option(None, "--measurements", help="with --model-factory: also write "
                                               "what the ranks measured, the plan's input, here (JSON)"),
    json_out: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    blocks: Optional[int] = typer.Option(None, "--blocks", help="blocks (layers) a pipeline could cut between, "
                                         "to compare DP, PP and DP×PP (default: from the model or preset)"),
    # the emulated devices' controlled clock (Emulation.sample_s), as a job given it runs:
    # for the accuracy benchmarks (benchmarks/_common.py), not a user's plan
    emulate_sample_s: Optional[float] = emulation_cli.sample_s_option(),
    emulate_micro_s: Optional[float] = emulation_cli.micro_s_option(),
) -> None:
    """Plan a job: each device's share, micro-batches and predicted throughput, with the reasons.

    With --model-factory the job's processes are started as `hetrain run` starts them and measure
    the model as the runtime does before training (profiles cached by model and device); the plan
    is the one the runtime would make from those measurements. With --model/--params it is
    estimated from the catalog. Every device takes part unless --allow-exclusion; the written plan
    runs with hetrain.init(global_batch=N, plan="plan.json").
    """
    from ..planning.planner import make_plan
    from ..runtime.measure.measurements import auto_request, plan_options

    if global_batch is None:
        raise UsageError("no --global-batch given", "give the samples per optimizer step over all devices, "
                         "as in hetrain.init(global_batch=N), e.g. --global-batch 64")
    check_common(global_batch, precision, memory_margin,
                  precisions=PRECISION_REQUESTS if model_factory else PRECISIONS)
    check_choice(checkpointing, CHECKPOINTINGS, "--checkpointing")
    savers = saver_options(offload, host_memory, checkpointing)
    if host_memory is None and not model_factory:     # an estimate: this host's available memory
        savers["host_memory_bytes"] = host_memory_available()
    if micro_batch is not None:
        positive_int(micro_batch, "--micro-batch", "give a positive cap, or leave it out")
    if model_factory and (model or params):
        raise UsageError("--model-factory and a --model/--params estimate both given", "give one of them")
    if model_factory and (trainable_params or lora is not None):
        raise UsageError("--trainable-params/--lora with --model-factory", "the factory's model says what "
                         "trains (parameters with requires_grad): drop them, or freeze in the factory")
    if measurements and not model_factory:
        raise UsageError("--measurements without --model-factory", "an estimate measures nothing: drop it")
    link = link_option(link_gbs)
    cluster = parse_cluster(emulate) if emulate is not None else None     # '' is a bad spec
    if blocks is not None:
        positive_int(blocks, "--blocks", "give the number of layers the model stacks")
    for path, flag in ((out, "--out"), (measurements, "--measurements")):
        if path:
            check_writable(path, flag)          # before measuring, not after it
    config = Config(global_batch=global_batch, precision=precision,
                    memory=Memory(margin=memory_margin, max_micro_batch=micro_batch,
                                  activation_checkpointing=checkpointing, oom_recovery=oom_recovery),
                    emulation=Emulation(cluster=emulate, sample_s=emulate_sample_s, micro_s=emulate_micro_s))
    if model_factory:
        from ..runtime.measure.measurements import plan_from_measurements, rank_job_measurements

        measured, config, found, facts = _measure_in_job(model_factory, config)
        blocks = blocks or found
        # parallel='auto' ranks with this same function (runtime/layouts/choose.decide).
        ranking, profiles, options = rank_job_measurements(measured, config, facts=facts, blocks=blocks, link=link)
        if offload != "plan" or host_memory is not None:     # re-ranked with the savers asked for
            from ..runtime.measure.measurements import recommended

            options = replace(options, **savers)
            state = ModelState(**{**facts, "blocks": blocks})
            check_offload_request(state, options)
            ranking = recommended(rank_layouts(profiles, state=state, options=options)) if ranking else None
        if measurements:
            write_text_atomic(measurements, measured.to_json())

        def make():
            return plan_from_measurements(measured, config, allow_exclusion=allow_exclusion, link=link)[0]
    else:
        spec = model_spec(model, params, flops_per_sample, activation_bytes, trainable_params, lora)
        blocks = blocks or spec.blocks
        profiles, default_link = _estimate(spec, cluster, precision)
        options = replace(plan_options(config, grad_bytes=spec.trainable * GRAD_ELEMENT_BYTES,
                                       link=link or default_link, allow_exclusion=allow_exclusion), **savers)
        state = replace(ModelState.from_spec(spec, precision=precision), blocks=blocks)
        check_offload_request(state, options)
        ranking = (rank_layouts(profiles, state=state, options=options, request=auto_request(config))   # auto's rule
                   if len(profiles) > 1 else None)

        def make():
            return make_plan(profiles, options)
    try:
        result = make()
    except UsageError as e:
        if ranking is None:
            raise
        show_ranking(ranking, title=f"every layout: global batch {global_batch} over {len(profiles)} devices")
        if ranking.best is not None:
            raise UsageError(e.what, f"plain data parallelism does not fit; the best layout that does: "
                             f"{ranking.best.name}, run it with {ranking.best.run}") from None
        left = next((r for r in ranking.rows if r.fits), None)      # fits, but auto's rule leaves it out
        if left is not None:
            raise UsageError(e.what, f"only layouts auto leaves out fit ({'; '.join(ranking.left_out)}): "
                             f"ask for {left.name} by name, {left.run}") from None
        raise UsageError("no layout fits memory on these devices", ranking.to_fit[0] if ranking.to_fit
                         else e.fix) from None
    if out:
        write_text_atomic(out, result.to_json())
    if json_out:
        typer.echo(result.to_json())
        return
    show_plan(result, out, emulate and emulation_cli.run_options(emulate), cluster, emulation_cli.run_options)
    if ranking is not None:
        show_ranking(ranking, title=f"every layout: global batch {global_batch} over {len(profiles)} devices"
                     + (" (blocks unknown: pipelines not compared; pass --blocks N)" if not blocks else ""))


def host_memory_available() -> float | None:
    """This host's available memory in bytes (psutil, else /proc/meminfo's MemAvailable; None: unknown)."""
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _measure_in_job(factory: str, config: Config):
    """The runtime's own measurements of the factory's model, taken in the job's processes
    (cli/plan_worker.py under the launcher `hetrain run` uses). Returns the measurements, the
    config the ranks ran with, the model's block count (None: not known) and its parameters as
    the layouts' memory sees them (runtime/layouts/ranking.model_facts)."""
    from ..launch import build_launch, run_launch
    from ..runtime.measure.factory import absolute, load_factory
    from ..runtime.measure.measurements import Measurements

    load_factory(factory)       # a bad spec or a missing function: one line now, before any process
    with tempfile.TemporaryDirectory(prefix="hetrain-plan-") as run_dir:
        job, result = os.path.join(run_dir, "job.json"), os.path.join(run_dir, "measured.json")
        write_json_atomic(job, {"factory": absolute(factory), "config": config.to_dict(), "out": result})
        launch = build_launch(target="hetrain.cli.plan_worker", target_args=(job,), module=True,
                              emulate=config.emulation.cluster, run_dir=run_dir)
        typer.echo(launch.describe(), err=True)
        code = run_launch(launch)
        if code:
            raise typer.Exit(code)      # the workers' error, printed once by the launcher
        with open(result) as f:
            measured = json.load(f)
    config = make_config(measured["config"], where="hetrain plan: the measured config")
    return Measurements.from_dict(measured["measurements"]), config, measured["blocks"], measured["model"]


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
    from .simulate import simulate

    app.command()(plan)
    app.command()(simulate)
