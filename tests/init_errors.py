"""A training script's first lines run in a rank of harness.py's process group (a forked
process, no torch import of its own): the error they raise. The CLI tests check a refusal
raised in the ranks this way, and launch `hetrain run` once per kind of refusal."""

from __future__ import annotations

import os


def raise_case(rank: int, world: int, code: str, cwd: str, argv: tuple[str, ...] = ()):
    """Run `code` as a script's __main__ in `cwd`, with `argv` after the script's name: (type name,
    what, fix) of what it raised, or None."""
    import sys

    from hetrain.errors import HetrainError

    os.chdir(cwd)
    sys.argv = [os.path.join(cwd, "s.py"), *argv]
    try:
        exec(compile(code, os.path.join(cwd, "s.py"), "exec"), {"__name__": "__main__"})
    except HetrainError as e:
        return type(e).__name__, e.what, e.fix
    except BaseException as e:       # noqa: BLE001 — reported, for the test to name
        return type(e).__name__, str(e), None
    return None
