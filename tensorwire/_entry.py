"""The ``tensorwire`` command's entry point: loads the command line, and ends quietly (exit 130,
as the command line does for a Ctrl-C once it runs) when Ctrl-C comes while it loads, which
took about half a second and printed the import machinery's KeyboardInterrupt traceback."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print("tensorwire: interrupted (SIGINT)", file=sys.stderr)
        return 130
    return run()
