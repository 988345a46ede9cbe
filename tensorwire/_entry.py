"""The ``tensorwire`` command's entry point: loads the command line with Ctrl-C and SIGTERM held.

Loading takes about half a second (numpy, gRPC). A Ctrl-C in that time is held until the
command line knows what it runs, and then ends it as a later one does (exit 130; ``bench
--json`` still prints its JSON report). Taken at once, it printed the import machinery's
KeyboardInterrupt traceback, or no JSON, or, landing inside a compiled module's
initialisation, an ImportError. A second Ctrl-C while loading ends the command at once.
SIGTERM is held the same way (exit 143, and ``bench --json``'s report; taken at once, the
process died of it with nothing on stdout); a second one ends the process at once, by the
signal itself.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_held: set[int] = set()  # the signals that came while they were held


class Terminated(Exception):
    """A SIGTERM came while the command line loaded: the command ends as on a later one."""


def _hold(signum: int, frame: object) -> None:
    if signum not in _held:
        _held.add(signum)
    elif signum == signal.SIGINT:  # the second: the user means now
        raise KeyboardInterrupt
    else:  # a second SIGTERM: die of it, as without tensorwire's handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _holdable() -> list[int]:
    """The signals to hold: only those whose default action is in place (Python's own handler
    for SIGINT), neither ignored nor handled by the program that calls the command line, and
    only in the main thread (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    default = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    return [signum for signum, handler in default.items() if signal.getsignal(signum) is handler]


def hold_interrupts() -> None:
    """Hold SIGINT and SIGTERM until ``release_interrupts`` (see ``_holdable``)."""
    for signum in _holdable():
        signal.signal(signum, _hold)


def release_interrupts(*, raise_held: bool = True) -> None:
    """Put the handlers back (Python's for SIGINT, the default for SIGTERM); then raise the
    KeyboardInterrupt of a Ctrl-C held meanwhile, or ``Terminated`` for a SIGTERM
    (``raise_held``), else forget them."""
    if threading.current_thread() is threading.main_thread():
        for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(signum) is _hold:
                signal.signal(signum, handler)
    held = set(_held)
    _held.clear()
    if raise_held and signal.SIGTERM in held:
        raise Terminated
    if raise_held and signal.SIGINT in held:
        raise KeyboardInterrupt


def while_held(load: Callable[[], T]) -> T | None:
    """``load()`` with Ctrl-C and SIGTERM held (``hold_interrupts``; the caller's
    ``release_interrupts`` later raises what was held meanwhile). None where a second Ctrl-C
    ended it at once (said on stderr: the command exits 130); any other failure releases them
    and propagates."""
    hold_interrupts()
    try:
        return load()
    except KeyboardInterrupt:  # a second Ctrl-C while loading
        release_interrupts(raise_held=False)
        print("tensorwire: interrupted (SIGINT)", file=sys.stderr)
        return None
    except BaseException:  # (for the command line: a usage error, --help or --version)
        release_interrupts(raise_held=False)
        raise


def _load_cli() -> Callable[[], int]:
    from .cli import main as run

    return run


def main() -> int:
    run = while_held(_load_cli)
    return 130 if run is None else run()
