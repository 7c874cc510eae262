"""The `hetrain` command. Thin: parses, calls the layers below, prints.

Errors hetrain can explain print as one line with the fix (exit 2 for bad input), never a
traceback.
"""

from __future__ import annotations

import sys

import typer

from ..errors import HetrainError

app = typer.Typer(
    name="hetrain",
    help="Train one PyTorch model across mixed GPUs at close to the sum of their speeds.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    from . import hardware, planning, train

    for module in (train, planning, hardware):
        module.register(app)


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        app(args=argv, prog_name="hetrain")
    except HetrainError as e:
        print(f"hetrain: error: {e.what}", file=sys.stderr)
        if e.fix:
            print(f"  fix: {e.fix}", file=sys.stderr)
        sys.exit(e.exit_code)
