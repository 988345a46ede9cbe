import compileall
import contextlib
import logging
import os
import signal
from pathlib import Path
from types import ModuleType

import pytest

_BACKGROUND = pytest.StashKey[list[ModuleType]]()


@pytest.fixture(autouse=True)
def _quiet_grpc_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorwire")


def pytest_configure(config: pytest.Config) -> None:
    """Started in the background by a shell without job control (``pytest ... &`` in a script),
    this process ignores SIGINT and its children inherit that, so the tests that interrupt a
    demo or a pipeline with SIGINT would see it ignored; give SIGINT back its usual meaning."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _compile_the_checkout()


def _compile_the_checkout() -> None:
    """Write the bytecode of this checkout's ``tensorwire`` and ``tests`` once (about 0.5 s).
    Where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) no process writes
    it, so every Python process the tests start (nodes, stages, demos, doctor: dozens) compiled
    the package from source again: 0.4-0.9 s each, about a quarter of the CPU time of the files
    that start processes. Reading bytecode is still allowed; a stale file is recompiled in
    memory as usual. A checkout that cannot be written is left as it is."""
    root = Path(__file__).resolve().parents[1]
    for folder in ("tensorwire", "tests"):
        with contextlib.suppress(OSError):
            compileall.compile_dir(root / folder, quiet=2)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the slow outside work of test modules that will run (their ``start_in_background``:
    the Soft-RoCE guests of test_verbs_vm.py) now, so it overlaps the rest of the suite. Not in
    an xdist worker (each would start its own) nor when only collecting; the module's fixtures
    then start it when first asked."""
    started: list[ModuleType] = []
    session.config.stash[_BACKGROUND] = started
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    for item in session.items:
        module = getattr(item, "module", None)
        start = getattr(module, "start_in_background", None)
        if module is None or start is None or module in started or item.get_closest_marker("skip"):
            continue
        start()
        started.append(module)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module in session.config.stash.get(_BACKGROUND, []):
        module.stop_in_background()
