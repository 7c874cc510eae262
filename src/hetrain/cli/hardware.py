"""`hetrain doctor` and `hetrain env`: what this machine is, and what will go wrong on it."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from ..errors import UsageError
from ..hardware import doctor as doctor_mod
from ..hardware import envreport, machine, ranks
from ..hardware.findings import DoctorOptions, parse_psu_watts

_STYLE = {"ok": "green", "warn": "yellow", "error": "bold red", "skipped": "dim"}
MACHINE_HELP = "check a recorded machine description (from `hetrain env --json`) instead of this machine"
CLUSTER_HELP = "check a planned cluster from the catalog, e.g. a100-80g,rtx3090 (no drivers asked)"


def _machine(machine_file: str | None, cluster: str | None, measure: bool) -> machine.Machine:
    # `is not None`: an empty --machine '' or --cluster '' is bad input, not "this machine".
    if machine_file is not None and cluster is not None:
        raise UsageError("--machine and --cluster both given", "give one: a recorded machine or a cluster spec")
    if measure and (machine_file is not None or cluster is not None):
        raise UsageError("--measure needs this machine's GPUs", "drop --machine/--cluster to measure here")
    if machine_file is not None:
        return machine.recorded(machine_file)
    if cluster is not None:
        return machine.planned(cluster)
    return machine.live(measure=measure)


def _islands(devices) -> list[str]:
    from ..hardware.islands import device_islands

    return device_islands(devices)


def _rank() -> int:
    """This process's rank under torchrun (0 alone): only rank 0 prints."""
    value = os.environ.get("RANK", "") or "0"
    if not (value.isdigit() and value.isascii()):
        raise UsageError(f"the environment variable RANK={value!r} is not a whole number >= 0",
                         "unset RANK, or launch with torchrun, which sets it")
    return int(value)


def _print_doctor(m: machine.Machine, findings) -> None:
    from rich.table import Table

    from ..console import console as make_console

    console = make_console(highlight=True, soft_wrap=False)   # wide off a terminal: one row per line in logs
    console.print(f"[bold]hetrain doctor[/bold] — {m.source}")
    from ..hardware.islands import device_islands

    devices = Table("device", "name", "vendor", "island", "memory", "cc", "catalog", "source", title="devices",
                    title_justify="left")
    for d, island in zip(m.devices, device_islands(m.devices)):
        summary = d.summary().split(", ")
        devices.add_row(d.label, d.name, d.vendor, island, summary[1] if len(summary) > 1 else "-",
                        "{}.{}".format(*d.compute_capability) if d.compute_capability else "-",
                        d.spec.key if d.spec else ("-" if d.kind == "cpu" else "not in catalog"), d.source)
    console.print(devices)
    table = Table("level", "check", "found (and why it matters)", "fix", title="findings", title_justify="left",
                  show_lines=True)
    for f in findings:
        found = f.message + (f"\n[dim]why: {f.why}[/dim]" if f.why else "")
        table.add_row(f"[{_STYLE[f.level]}]{f.level}[/]", f.check, found, f.fix or "-")
    console.print(table)
    c = doctor_mod.counts(findings)
    console.print(", ".join(f"[{_STYLE[k]}]{n} {k}[/]" for k, n in c.items()))


def doctor(
    json_out: bool = typer.Option(False, "--json", help="machine-readable output: {devices, findings, ...}"),
    psu_watts: Optional[str] = typer.Option(None, "--psu-watts", help="your power supply's rating in watts, "
                                            "to check the seed's 30% headroom over the GPUs' power limits"),
    precision: str = typer.Option("auto", "--precision",
                                  help="the job's precision: auto (recommend), bf16, fp16, fp32"),
    measure: bool = typer.Option(False, "--measure", help="also measure copy bandwidth between GPUs (a few seconds)"),
    machine_file: Optional[str] = typer.Option(None, "--machine", help=MACHINE_HELP),
    cluster: Optional[str] = typer.Option(None, "--cluster", help=CLUSTER_HELP),
) -> None:
    """Check this machine for multi-GPU traps; each finding says what, why and the exact fix.
    Exit code 1 when any finding is an error."""
    rank = _rank()
    options = DoctorOptions(psu_watts=parse_psu_watts(psu_watts), precision=precision)
    m = _machine(machine_file, cluster, measure)
    if not (machine_file or cluster) and ranks.under_torchrun():
        options = DoctorOptions(psu_watts=options.psu_watts, precision=options.precision,
                                rank_versions=ranks.gather_rank_versions(m.facts))
    findings = doctor_mod.run_checks(m, options)
    if rank == 0:
        if json_out:
            typer.echo(json.dumps({
                "source": m.source, "devices": [{**d.to_dict(), "island": island} for d, island
                                                in zip(m.devices, _islands(m.devices))],
                "topology": [ln.to_dict() for ln in m.links],
                "findings": [f.to_dict() for f in findings], "counts": doctor_mod.counts(findings)}, indent=2))
        else:
            _print_doctor(m, findings)
    raise typer.Exit(doctor_mod.exit_code(findings))


def env(
    json_out: bool = typer.Option(False, "--json", help="machine-readable: the machine description, devices, "
                                  "topology (a file `hetrain doctor --machine` can read)"),
    measure: bool = typer.Option(False, "--measure", help="also measure copy bandwidth between GPUs"),
    machine_file: Optional[str] = typer.Option(None, "--machine", help=MACHINE_HELP),
    cluster: Optional[str] = typer.Option(None, "--cluster", help=CLUSTER_HELP),
) -> None:
    """A paste-ready report for bug reports: versions, every GPU, topology, relevant env vars."""
    rank = _rank()
    m = _machine(machine_file, cluster, measure)
    per_rank = ranks.gather_rank_versions(m.facts) if not (machine_file or cluster) and ranks.under_torchrun() else None
    if rank != 0:
        return
    if json_out:
        typer.echo(json.dumps(envreport.render_json(m, per_rank), indent=2))
    else:
        typer.echo(envreport.render_text(m, per_rank), nl=False)


def register(app: typer.Typer) -> None:
    app.command()(doctor)
    app.command()(env)
