"""`hetrain run` and `hetrain demo`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer

from ..emulation import cli as emulation_cli
from ..errors import UsageError
from ..launch import build_launch, run_launch
from ..launching.nodes import rendezvous
from ..files import check_writable, write_json_atomic
from ..vocabulary import COMPRESSION_REQUESTS, PRECISION_REQUESTS, check_choice

DEMO_CLUSTER = "a100-80g:1.0,rtx3090:0.67"
_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}


VERBOSE_STATUS_EVERY = 10      # --verbose: steps between the per-device status lines


def run(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="the training script (or module, with -m)"),
    emulate: Optional[str] = emulation_cli.option(
        "emulated cluster, e.g. a100-80g,rtx3090 or a100-80g:1.0,rtx3090:0.67@1GiB"),
    module: bool = typer.Option(False, "-m", "--module", help="SCRIPT is a module name (python -m)"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="process count (default: one per device)"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="restart the job this many times after a crash"),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="where the launch file (and checkpoints) go"),
    checkpoint_dir: Optional[str] = typer.Option(
        None, "--checkpoint-dir", help="checkpoint here (overrides the script's Checkpoints(dir=...)); "
                                                        "resumes from it"),
    metrics_dir: Optional[str] = typer.Option(
        None, "--metrics-dir", help="rank 0 appends one JSON line per step to DIR/metrics.jsonl (default: "
                                    "CHECKPOINT_DIR/metrics when checkpointing); `hetrain report DIR` draws it"),
    status_every: Optional[int] = typer.Option(
        None, "--status-every", help="rank 0 prints a status line per device every N steps"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=f"every reason behind the plan and the launch, and "
                                 f"a status line per device every {VERBOSE_STATUS_EVERY} steps (--status-every N for "
                                 "another interval)"),
    allow_fallback: bool = typer.Option(
        False, "--allow-fallback",
        help="a device that cannot run the script's precision runs the nearest it can (bf16 -> fp16 on a V100)"),
    precision: Optional[str] = typer.Option(
        None, "--precision", help="overrides the script's precision: auto, fp32, bf16 or fp16"),
    faults: Optional[str] = typer.Option(
        None, "--faults", help="inject faults on emulated devices, e.g. 'oom:rank=1,step=3,micro=0;die:rank=1,step=5' "
                               "(runtime/devices/faults.py; replaces HETRAIN_FAULTS)"),
    nnodes: Optional[str] = typer.Option(
        None, "--nnodes", help="nodes in the job: N, or MIN:MAX (elastic); every node runs `hetrain run` with the same"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="this node's rank: 0 on the node at the endpoint"),
    rdzv_endpoint: Optional[str] = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of node rank 0, where torchrun's c10d rendezvous runs"),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="the job's id, the same on every node"),
    rdzv_timeout: float = typer.Option(300.0, "--rdzv-timeout", help="seconds to wait for the endpoint and the nodes"),
    rdzv_last_call: float = typer.Option(
        30.0, "--rdzv-last-call", help="seconds an elastic round with MIN nodes waits for more before it starts"),
    node_name: Optional[str] = typer.Option(None, "--node-name", help="this node's name in the job's output"),
    compression: Optional[str] = typer.Option(
        None, "--compression", help="gradient compression: auto (planned: fp16/bf16 when a slow inter-node link "
                                    "makes it pay), none, fp16, bf16 (NCCL), powersgd (an approximation)"),
    emulate_link_gbs: Optional[float] = emulation_cli.link_gbs_option(),
    no_swap: bool = typer.Option(
        False, "--no-swap", help="run the script's own transformers/TRL Trainer and accelerate.Accelerator classes "
                                 "(by default hetrain's replace them in the workers: a stock script needs no edit)"),
    slurm: bool = typer.Option(False, "--slurm", help="take --nnodes, --node-rank, --rdzv-endpoint and --rdzv-id "
                                                     "from Slurm's variables (one `hetrain run` per node under srun)"),
) -> None:
    """Launch SCRIPT [ARGS] on every device (or emulated device) through torchrun."""
    if precision is not None:
        check_choice(precision, PRECISION_REQUESTS, "--precision")
    if compression is not None:
        check_choice(compression, COMPRESSION_REQUESTS, "--compression")
    emulation_cli.check_link_gbs(emulate_link_gbs)
    if faults is not None:
        emulation_cli.check_faults(faults, emulate, multi_node=nnodes is not None)
    if status_every is not None and status_every < 0:
        raise UsageError(f"--status-every {status_every} is negative", "give a number of steps, e.g. --status-every 10")
    if verbose and status_every is None:
        status_every = VERBOSE_STATUS_EVERY
    if metrics_dir is not None:
        _check_metrics_dir(metrics_dir)
    if slurm:
        given = [flag for flag, v in (("--nnodes", nnodes), ("--node-rank", node_rank),
                                      ("--rdzv-endpoint", rdzv_endpoint), ("--rdzv-id", rdzv_id)) if v is not None]
        if given:
            raise UsageError(f"--slurm with {', '.join(given)}: --slurm reads them from Slurm's variables",
                             "drop --slurm to give them yourself, or drop them")
        from ..launching.slurm import from_slurm

        job = from_slurm(os.environ)
        nnodes, node_rank, rdzv_endpoint, rdzv_id = str(job.nnodes), job.node_rank, job.endpoint, job.rdzv_id
        for reason in job.reasons:
            typer.echo(f"--slurm: {reason}", err=True)
    rdzv = rendezvous(nnodes=nnodes, node_rank=node_rank, endpoint=rdzv_endpoint, run_id=rdzv_id,
                      timeout_s=rdzv_timeout, last_call_s=rdzv_last_call)
    launch = build_launch(target=script, target_args=tuple(ctx.args), module=module, emulate=emulate,
                          nproc=nproc, max_restarts=max_restarts, run_dir=run_dir, rdzv=rdzv, node_name=node_name,
                          swap=not no_swap, config={"checkpoints": {"dir": checkpoint_dir},
                                  "reporting": {"metrics_dir": metrics_dir, "status_every": status_every,
                                                "details": True if verbose else None},
                                  "allow_fallback": allow_fallback or None, "precision": precision,
                                  "emulation": {"faults": faults, "link_gbs": emulate_link_gbs},
                                  "compression": {"method": compression}})
    typer.echo(describe(launch, verbose), err=True)
    raise typer.Exit(run_launch(launch))


def describe(launch, verbose: bool) -> str:
    """What `hetrain run`/`demo` say before the workers start: everything under --verbose; else the
    process count and each reason a user may act on, without torchrun's command line."""
    if verbose:
        return launch.describe()
    kept = [r for r in launch.reasons if not r.startswith(emulation_cli.INTERNAL_REASONS)]
    return "\n".join([f"launching {launch.nproc} process(es) with torchrun (--verbose: its command and every "
                      "reason)", *(f"  {r}" for r in kept)])


def _check_metrics_dir(path: str) -> None:
    """--metrics-dir must be (or become) a directory we can write: said before anything starts."""
    existing = next((p for p in (path, *(str(a) for a in Path(path).parents)) if os.path.exists(p)), ".")
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--metrics-dir {path!r}: {existing!r} is not a writable directory",
                         "give a directory you can write (it is made if missing)")


def demo(
    emulate: str = emulation_cli.option("emulated cluster (default: A100-80G + RTX 3090 at the measured 1 : 0.67)",
                                        DEMO_CLUSTER, "--cluster"),
    steps: int = typer.Option(300, "--steps", help="optimizer steps"),
    global_batch: int = typer.Option(64, "--global-batch", help="samples per step, all devices together"),
    precision: str = typer.Option("auto", "--precision",
                                  help="auto (each card's own: bf16 from compute capability 8.0, else fp16; "
                                       "computed in fp32 where this CPU runs that slowly), fp32, bf16 or fp16"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the run's figures to this file"),
    metrics_dir: Optional[str] = typer.Option(
        None, "--metrics-dir", help="one JSON line per step in DIR/metrics.jsonl; `hetrain report DIR` draws it"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=f"every reason behind the plan and the launch, "
                                 f"and a status line per device every {VERBOSE_STATUS_EVERY} steps"),
) -> None:
    """Train a small GPT on Python's own docs across an emulated mixed cluster (no GPU needed)."""
    started = time.perf_counter()
    check_choice(precision, PRECISION_REQUESTS, "--precision")
    if steps < 1:
        raise UsageError(f"--steps {steps} must be at least 1")
    if global_batch < 1:
        raise UsageError(f"--global-batch {global_batch} must be at least 1")
    if json_path:
        check_writable(json_path, "--json")      # before training, not after it
    if metrics_dir is not None:
        _check_metrics_dir(metrics_dir)
    args = ["--steps", str(steps), "--global-batch", str(global_batch), "--precision", precision]
    if json_path:
        args += ["--json", json_path]
    launch = build_launch(target="hetrain.demo.train_gpt", target_args=tuple(args), module=True,
                          emulate=emulate, config={"reporting": {
                              "metrics_dir": metrics_dir, "status_every": VERBOSE_STATUS_EVERY if verbose else None,
                              "details": True if verbose else None}})
    typer.echo(describe(launch, verbose), err=True)
    code = run_launch(launch)
    if code == 0 and json_path and os.path.isfile(json_path):
        # The whole command's wall time (start-up, planning and training), as a user waits for it.
        with open(json_path) as f:
            figures = json.load(f)
        write_json_atomic(json_path, {"wall_s": time.perf_counter() - started, **figures})
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(context_settings=_PASSTHROUGH)(run)
    app.command()(demo)
