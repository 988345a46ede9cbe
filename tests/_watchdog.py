"""A last resort against a test that hangs where pytest-timeout cannot stop it.

pytest-timeout's signal method raises in the main thread from a SIGALRM handler, and Python runs
that handler only when the main thread comes back to the interpreter: a test stuck inside a C
call that does not return (a lock in a native library, a progress call that spins, a signal
blocked) runs on without end, and the suite with it, until the CI's 90 minutes are gone, with
nothing to say where it stuck. Here each test also arms faulthandler's watchdog, a C thread that
needs neither the GIL nor the main thread: ``GRACE`` seconds after the test's own timeout has
passed it writes every thread's stack to the terminal's stderr and ends the process (exit code
1), so the run fails in minutes and names the place.

Registered by ``tests/conftest.py`` (``pytest_plugins``); a run may register it alone with
``-p _watchdog`` (tests/ on ``sys.path``). ``TW_TEST_HANG_GRACE`` overrides ``GRACE``."""

from __future__ import annotations

import contextlib
import faulthandler
import os
from collections.abc import Generator
from typing import Any

import pytest

GRACE = 120.0  # s after a test's timeout: time for the signal method, then for the teardown it runs
_STDERR = pytest.StashKey[int]()


def _grace() -> float:
    return float(os.environ.get("TW_TEST_HANG_GRACE", GRACE))


def _timeout(item: pytest.Item) -> float:
    """The test's timeout as pytest-timeout reads it: its ``timeout`` mark, else ``--timeout``,
    else the ini's (0 or none: no limit, and no watchdog)."""
    mark = item.get_closest_marker("timeout")
    value: Any = None
    if mark is not None:
        value = mark.kwargs.get("timeout", mark.args[0] if mark.args else None)
    if value is None:
        value = item.config.getoption("timeout", None)
    if value is None:
        value = item.config.getini("timeout")
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def pytest_configure(config: pytest.Config) -> None:
    """Keep a descriptor of the stderr the run started with. Under pytest's output capture
    descriptor 2 is a temporary file while a test runs, and the process that the watchdog ends
    never copies that file out: its stacks would be lost."""
    capture = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(capture, "_global_capturing", None), "err", None)
    fd = getattr(err, "targetfd_save", None)  # (FDCapture's copy of the real descriptor 2)
    config.stash[_STDERR] = os.dup(fd if isinstance(fd, int) else 2)


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_STDERR, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    timeout = _timeout(item)
    fd = item.config.stash.get(_STDERR, None)
    if timeout <= 0 or fd is None:
        return (yield)
    faulthandler.dump_traceback_later(timeout + _grace(), exit=True, file=fd)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
