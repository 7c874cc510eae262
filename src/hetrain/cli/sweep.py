"""`hetrain sweep`: hyperparameter trials at once over mixed devices, on Optuna (sweeping/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from ..emulation import cli as emulation_cli
from ..errors import UsageError
from ..files import check_writable, write_json_atomic


def sweep(
    objective: str = typer.Argument(..., help="the objective file: a stock Optuna script (objective(trial) and, "
                                    "under __main__, create_study and study.optimize: its direction, sampler, pruner "
                                    "and n_trials are used), Optuna's objective(trial) -> float alone (its device "
                                    "from hetrain.sweep.device()), or space(trial) -> dict and train(params, ctx) -> "
                                    "float; optionally memory(params) -> dict for placement"),
    emulate: Optional[str] = emulation_cli.option("emulated devices, e.g. a100-80g,rtx3090 "
                                                  "(default: this machine's GPUs, a trial per GPU at a time)"),
    trials: Optional[int] = typer.Option(None, "--trials", help="trials the study should have finished: complete, "
                                         "pruned and failed ones all count (a resumed sweep counts the ones it "
                                         "already has); a stock script's n_trials unless given"),
    storage: str = typer.Option("sweep.db", "--storage", help="the study's SQLite file (created, or continued)"),
    study: Optional[str] = typer.Option(None, "--study", help="the study's name (default: the objective file's)"),
    pruner: Optional[str] = typer.Option(None, "--pruner", help="median (the default: Optuna's MedianPruner with "
                                         "its defaults: median:startup=5,warmup=0,interval=1, each settable) or none; "
                                         "a stock script's own pruner unless given"),
    direction: Optional[str] = typer.Option(None, "--direction", help="minimize (the default) or maximize the "
                                            "objective's value; a stock script's create_study gives its own"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the figures and every trial here"),
    emulate_sample_s: Optional[float] = emulation_cli.sample_s_option(
        "emulated devices on a controlled clock (benchmarks)"),
) -> None:
    """Run an Optuna study's trials at once, one per device, the bigger trials on the bigger cards
    (the planner's memory model decides what fits where); the study is kept in SQLite, so the same
    command resumes it after a crash (a trial left running is run again), and a worker that dies is
    replaced. A trial too big for any one device runs as a hetrain data-parallel job over a group of
    them (the memory model picks the group and its sharding); one that fits no group stops the sweep.
    Pruned and failed trials count toward --trials. A stock Optuna script runs as written: its
    __main__ runs, its create_study makes the sweep's study (direction, sampler, pruner) and its
    study.optimize runs the trials over the devices."""
    from ..integrations import require

    require("optuna", extra="sweep", feature="hetrain sweep")
    from ..sweeping.objective import load_objective, main_creates_study
    from ..sweeping.runner import DIRECTIONS, SweepSetup, run_sweep
    from ..sweeping.study import parse_pruner
    from ..sweeping.summary import print_table, to_dict

    if trials is not None and trials < 1:
        raise UsageError(f"--trials {trials} must be at least 1", "give the number of trials, e.g. --trials 20")
    if pruner is not None:
        parse_pruner(pruner)
    if direction is not None and direction not in DIRECTIONS:
        raise UsageError(f"--direction {direction!r} is not one of {', '.join(DIRECTIONS)}",
                         f"use --direction {DIRECTIONS[0]}")
    _check_storage(storage)
    if json_path:
        check_writable(json_path, "--json")
    if emulate_sample_s is not None and not 0 < emulate_sample_s <= 10:
        raise UsageError(f"--emulate-sample-s {emulate_sample_s}", "give the clock's seconds per sample, e.g. 0.002")
    path = os.path.abspath(objective)
    load_objective(path)                       # a missing file or form: one line, before any worker
    stock = main_creates_study(path)
    if trials is None and not stock:
        raise UsageError("--trials is missing", "give the number of trials, e.g. --trials 20")
    slots, targets = _devices(emulate)
    setup = SweepSetup(objective=path, storage=storage, study=study or Path(objective).stem,
                       trials=trials, slots=slots, targets=targets, pruner=pruner or "median",
                       direction=direction or DIRECTIONS[0], sample_s=emulate_sample_s)
    say = lambda line: typer.echo(line, err=True)  # noqa: E731

    def report(result) -> None:
        print_table(result)
        if json_path:
            write_json_atomic(json_path, to_dict(result))
            typer.echo(f"wrote {json_path}")

    if stock:
        from ..sweeping.main_form import MainRun

        given = {name for name, value in (("trials", trials), ("direction", direction), ("pruner", pruner),
                                          ("study", study)) if value is not None}
        MainRun(setup, given=given, say=say, report=report).run()
    else:
        report(run_sweep(setup, say=say))


def _check_storage(path: str) -> None:
    """The SQLite file must be creatable (or writable) now, not after the first trial."""
    p = Path(path)
    for parent in p.resolve().parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--storage {path!r}: {str(parent)!r} is a file, not a directory",
                             "give a path in a directory, e.g. --storage sweep.db")
    check_writable(path, "--storage")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"--storage {path!r} is not writable", "give a file you can write, or another --storage")


def _devices(emulate: str | None):
    from ..sweeping.placement import Slot

    if emulate is not None:
        from ..emulation.trials import TARGET
        from ..hardware.cluster import parse_cluster

        devices = parse_cluster(emulate)
        return (tuple(Slot(index=d.index, label=f"{d.label} (emulated)", memory_bytes=d.memory_bytes, speed=d.speed,
                           spec=f"{d.gpu.key}:{d.speed}@{d.memory_bytes / 2**20:g}MiB") for d in devices),
                (TARGET,) * len(devices))
    import torch

    if not torch.cuda.is_available():
        raise emulation_cli.no_gpu("sweep")
    slots = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        slots.append(Slot(index=i, label=f"{props.name}#{i}", memory_bytes=props.total_memory,
                          speed=props.multi_processor_count / 100))   # a rank for placement ties, not a figure
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return tuple(slots), tuple(visible[i] if i < len(visible) else str(i) for i in range(len(slots)))


def register(app: typer.Typer) -> None:
    app.command()(sweep)
