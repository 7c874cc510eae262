"""The `hetrain` command. Thin: parses, calls the layers below, prints.

Errors hetrain can explain print as one line with the fix (exit 2 for bad input), never a
traceback.
"""

from __future__ import annotations

import functools
import sys

import typer

from ..errors import HetrainError, say
from ..process_exit import skip_final_collection

app = typer.Typer(
    name="hetrain",
    help="Train one PyTorch model across mixed GPUs at close to the sum of their speeds.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@functools.cache
def _register() -> None:
    """Once per process: main() may be called many times in one (the tests do)."""
    from . import bench, hardware, planning, report, sweep, train

    for module in (train, planning, bench, hardware, report, sweep):
        module.register(app)


def main(argv: list[str] | None = None) -> None:
    """Run the command; always ends in SystemExit with its exit code."""
    skip_final_collection()     # the launcher's exit, after its workers': ~0.5 s sooner
    _register()
    try:
        code = app(args=argv, prog_name="hetrain", standalone_mode=False)
    except HetrainError as e:
        say(e.what, e.fix)
        sys.exit(e.exit_code)
    except typer.TyperException as e:              # what typer's click could not parse: the same one line
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()                               # bare `hetrain`: the help, as before
        else:
            ctx = getattr(e, "ctx", None)
            say(" ".join(e.format_message().split()),
                f"see `{ctx.command_path if ctx is not None else 'hetrain'} --help`")
        sys.exit(e.exit_code)
    except typer.Abort:                            # Ctrl-C before any worker ran (a running job stops
        print("hetrain: interrupted", file=sys.stderr)   # at a step boundary instead: resilience/preempt.py)
        sys.exit(130)
    sys.exit(code or 0)

