"""`hetrain bench`: is my second GPU worth it? Each device alone, the equal split and hetrain, measured
on the user's model and devices in one command (the runs: benching/runs.py)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from ..emulation import cli as emulation_cli
from ..errors import UsageError
from ..files import check_writable, write_json_atomic
from ..vocabulary import PRECISION_REQUESTS, check_choice

DEFAULT_STEPS = 10      # a 2-device emulated bench of a small model in about a minute on 2 cores
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 3      # benching.runs.DEFAULT_ROUNDS, without importing the runs before parsing


def bench(
    model_factory: str = typer.Option(..., "--model-factory", help="MODULE:FUNCTION or SCRIPT.py:FUNCTION "
                                      "returning (model, optimizer, dataset[, collate_fn]), as `hetrain plan` takes"),
    emulate: Optional[str] = emulation_cli.option("emulated devices, e.g. a100-80g,rtx3090 "
                                                  "(default: this machine's GPUs, one process each)"),
    steps: int = typer.Option(DEFAULT_STEPS, "--steps", help="timed optimizer steps per configuration"),
    warmup: int = typer.Option(DEFAULT_WARMUP, "--warmup", help="untimed steps before them"),
    global_batch: int = typer.Option(64, "--global-batch", help="samples per step, all devices together"),
    precision: str = typer.Option("auto", "--precision", help="auto (each card's own), fp32, bf16 or fp16"),
    rounds: int = typer.Option(DEFAULT_ROUNDS, "--rounds", help="interleaved rounds of every configuration; each "
                               "figure is the median of its rounds"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the figures here"),
    png_path: Optional[str] = typer.Option(None, "--png", help="draw a bar chart of the configurations here"),
) -> None:
    """Measure each device alone, an equal split and hetrain's split on your model: samples/s,
    speedups, efficiency (hetrain / the sum of the standalone figures) and peak memory."""
    from ..benching.runs import BenchSetup, RunFailed, run_bench
    from ..benching.show import draw_png, print_table
    from ..runtime.measure.factory import absolute, load_factory

    if steps < 1:
        raise UsageError(f"--steps {steps} must be at least 1", "give the timed steps per run, e.g. --steps 20")
    if rounds < 1:
        raise UsageError(f"--rounds {rounds} must be at least 1",
                         f"give the interleaved rounds, e.g. --rounds {DEFAULT_ROUNDS} (each figure is their median)")
    check_choice(precision, PRECISION_REQUESTS, "--precision")
    for path, flag in ((json_path, "--json"), (png_path, "--png")):
        if path:
            check_writable(path, flag)          # before any run, not after all of them
    if png_path:
        _check_matplotlib()
    devices = _devices(emulate)
    load_factory(model_factory)                 # a bad spec or a missing function: one line, now
    setup = BenchSetup(factory=absolute(model_factory), emulate=emulate, devices=devices, global_batch=global_batch,
                       steps=steps, warmup=warmup, precision=precision, rounds=rounds)
    try:
        result = run_bench(setup, say=lambda line: typer.echo(line, err=True))
    except RunFailed as e:
        raise typer.Exit(e.code) from None
    print_table(result)
    if json_path:
        write_json_atomic(json_path, result.to_dict())
        typer.echo(f"wrote {json_path}")
    if png_path:
        draw_png(result, png_path)
        typer.echo(f"wrote {png_path}")


def _devices(emulate: str | None) -> tuple[str, ...]:
    """One launch target per device: its own emulated spec, or its GPU's CUDA index."""
    if emulate is not None:
        from ..hardware.cluster import parse_cluster

        emulation_cli.one_machine(emulate, "bench")
        return tuple(_one_device_spec(d) for d in parse_cluster(emulate))
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise emulation_cli.no_gpu("bench")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return tuple(ids[:count])


def _one_device_spec(d) -> str:
    """A device of a cluster spec as a spec of its own, with its speed and memory as given."""
    spec = d.gpu.key
    if not d.speed_source.startswith("catalog"):
        spec += f":{d.speed!r}"
    if not d.memory_source.startswith("catalog"):
        spec += f"@{d.memory_bytes}B"
    return spec


def _check_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--png needs matplotlib, which is not installed", "pip install matplotlib, or drop --png")


def register(app: typer.Typer) -> None:
    app.command()(bench)
