"""`hetrain report`: a run's metrics.jsonl as pictures."""

from __future__ import annotations

import os
from typing import Optional

import typer

from ..errors import UsageError


def report(
    run_dir: str = typer.Argument(..., help="the metrics dir of a run (--metrics-dir), or its checkpoint dir"),
    out: Optional[str] = typer.Option(None, "--out", help="write the PNGs here (default: beside metrics.jsonl)"),
) -> None:
    """Draw a run's metrics.jsonl: per-device time per step, shares, loss, memory and MFU (PNG)."""
    from ..reporting import runlog

    path = runlog.find(run_dir)
    out_dir = out if out is not None else os.path.dirname(path)
    if not os.path.isdir(out_dir):
        raise UsageError(f"report: --out {out_dir!r} is not a directory", "create it first, or give an existing one")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise UsageError(f"report: --out {out_dir!r} is not writable", "give a directory you can write")
    log = runlog.read(path)
    from ..reporting import plots

    for written in plots.draw_all(log, out_dir):
        typer.echo(written)


def register(app: typer.Typer) -> None:
    app.command()(report)
