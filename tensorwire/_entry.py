"""The ``tensorwire`` command's entry point: loads the command line, and ends quietly (exit 130,
as the command line does for a Ctrl-C once it runs) when Ctrl-C comes while it loads, which
took about half a second and printed the import machinery's KeyboardInterrupt traceback."""

from __future__ import annotations

import gc
import sys


def main() -> int:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print("tensorwire: interrupted (SIGINT)", file=sys.stderr)
        return 130
    return exiting(run())


def exiting(code: int) -> int:
    """The command's exit code, on its way out: the interpreter's last collection walks every
    object a command made (torch's: 0.8-2 s for a stage), which all die with the process
    anyway, so none is left for it to walk (``python -m tensorwire.cli`` ends this way too)."""
    gc.freeze()
    return code
