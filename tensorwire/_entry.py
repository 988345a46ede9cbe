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


def main() -> int:
    hold_interrupts()
    try:
        from .cli import main as run
    except KeyboardInterrupt:  # a second Ctrl-C while loading
        release_interrupts(raise_held=False)
        print("tensorwire: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except BaseException:
        release_interrupts(raise_held=False)
        raise
    return run()
