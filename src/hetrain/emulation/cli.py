"""The emulator on the command line: the `--emulate SPEC` option that `hetrain run`, `demo`, `plan`,
`bench` and `sweep` declare (each with its own help; SPEC is a cluster spec, hardware/cluster.py),
the hidden controlled-clock options of `plan` and `sweep`, and what these commands refuse or leave
unsaid about emulated devices. Only the CLI imports it; it loads no torch.
"""

from __future__ import annotations

from typing import Optional

import typer

from ..errors import UsageError

EXAMPLE = "a100-80g,rtx3090"
# The launcher's reasons that only explain the emulation's own set-up (`--verbose` prints them):
# the plan's precision column says what an emulated device computes in.
INTERNAL_REASONS = ("OMP_NUM_THREADS=", "host CPU: ", "zero-change mode: ")
# What a command without GPUs and without --emulate suggests instead.
_NO_GPU_FIX = {"bench": f"bench emulated devices on this CPU: --emulate {EXAMPLE}",
               "sweep": f"sweep on emulated devices: --emulate {EXAMPLE}"}


def option(help: str, default: Optional[str] = None, *aliases: str):
    """The `--emulate SPEC` option, with the command's own help (and default, and other names)."""
    return typer.Option(default, "--emulate", *aliases, help=help)


def run_options(spec: str) -> str:
    """The `hetrain run` options that launch on the emulated devices a cluster spec names."""
    return f"--emulate {spec}"


def sample_s_option(help: Optional[str] = None):
    """`--emulate-sample-s`: the emulated devices' controlled clock (Emulation.sample_s), for the
    benchmarks and tests, not a user's run (hidden)."""
    return typer.Option(None, "--emulate-sample-s", hidden=True, help=help)


def micro_s_option():
    """`--emulate-micro-s`: the controlled clock's seconds per micro-batch (Emulation.micro_s; hidden)."""
    return typer.Option(None, "--emulate-micro-s", hidden=True)


def link_gbs_option():
    """`--emulate-link-gbs`: the emulated inter-node link (Emulation.link_gbs)."""
    return typer.Option(None, "--emulate-link-gbs", help="emulated devices on several nodes: the inter-node link's GB/s")


def check_link_gbs(gbs: Optional[float]) -> None:
    if gbs is not None and not 0 < gbs <= 10_000:
        raise UsageError(f"--emulate-link-gbs {gbs:g} must be in (0, 10000]", "e.g. --emulate-link-gbs 1.0")


def no_gpu(command: str) -> UsageError:
    """The error of `hetrain bench`/`sweep` on a machine without GPUs when --emulate is not given."""
    return UsageError("no GPU here and no --emulate", _NO_GPU_FIX[command])


def one_machine(emulate: str, command: str) -> None:
    """Commands that run on one machine take the devices only, not the nodes form."""
    if "=" in emulate or ";" in emulate:
        raise UsageError(f"--emulate {emulate!r} names nodes: `hetrain {command}` runs on one machine",
                         f"give the devices only, e.g. --emulate {EXAMPLE}")


def check_faults(spec: str, emulate: Optional[str], *, multi_node: bool = False) -> None:
    """A bad fault spec, or faults without emulated devices, is one line before anything starts
    (the workers would each refuse it after the launch)."""
    from ..hardware.cluster import parse_cluster
    from ..runtime.devices.faults import parse_faults

    parsed = parse_faults(spec)
    if not parsed:
        raise UsageError(f"--faults {spec!r} names no fault", "e.g. --faults 'die:rank=1,step=5'")
    if emulate is None:
        raise UsageError("--faults needs emulated devices (fault injection acts on their processes)",
                         f"add --emulate, e.g. --emulate {EXAMPLE}")
    count = len(parse_cluster(emulate))
    if multi_node:            # ranks are the job's, over every node: this node cannot bound them
        return
    for f in parsed:
        if not -1 <= f.rank < count:      # it would never fire, silently
            raise UsageError(f"--faults: rank={f.rank} in {spec!r}, but --emulate names {count} "
                             f"device{'s' if count != 1 else ''}",
                             f"use a rank from 0 to {count - 1}, or -1 for every rank")
