"""The ``tensorwire`` command's entry point: loads the command line with Ctrl-C held.

Loading takes about half a second (numpy, gRPC). A Ctrl-C in that time is held until the
command line knows what it runs, and then ends it as a later one does (exit 130; ``bench
--json`` still prints its JSON report). Taken at once, it printed the import machinery's
KeyboardInterrupt traceback, or no JSON, or, landing inside a compiled module's
initialisation, an ImportError. A second Ctrl-C while loading ends the command at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_held = False  # a Ctrl-C came while SIGINT was held


def _hold(signum: int, frame: object) -> None:
    global _held
    if _held:  # the second: the user means now
        raise KeyboardInterrupt
    _held = True


def hold_interrupts() -> None:
    """Hold SIGINT until ``release_interrupts``. Only where Python's own handler is in place
    (not where SIGINT is ignored, or handled by the program that calls the command line) and
    only in the main thread (where Python runs signal handlers)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
        signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _hold)


def release_interrupts(*, raise_held: bool = True) -> None:
    """Put Python's SIGINT handler back; then raise the KeyboardInterrupt of a Ctrl-C held
    meanwhile (``raise_held``), else forget it."""
    global _held
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _hold:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    held, _held = _held, False
    if held and raise_held:
        raise KeyboardInterrupt


def while_held(load: Callable[[], T]) -> T | None:
    """``load()`` with Ctrl-C held (``hold_interrupts``; the caller's ``release_interrupts``
    later raises a Ctrl-C held meanwhile). None where a second Ctrl-C ended it at once (said on
    stderr: the command exits 130); any other failure releases SIGINT and propagates."""
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
