import compileall
import contextlib
import gc
import logging
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Generator
from pathlib import Path
from types import ModuleType
from typing import TextIO

import pytest

pytest_plugins = ["_watchdog"]  # (a test hung past its timeout ends the run, with every stack)

_BACKGROUND = pytest.StashKey[list[ModuleType]]()
_LEAKS = pytest.StashKey[list[warnings.WarningMessage]]()
_PACKAGE = str(Path(__file__).resolve().parents[1] / "tensorwire") + os.sep
_CHILD_LEAKS = pytest.StashKey["_ChildLeaks"]()


@pytest.fixture(autouse=True)
def _quiet_grpc_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorwire")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Collect the leak warnings tensorwire gives while this test runs (a node left open, closed
    as its event loop shut down; a Pipeline collected unclosed) for ``pytest_runtest_teardown``
    to fail the test with. Under the suite's "error" filter they were raised where nobody could
    see them: the node's in ``loop.shutdown_asyncgens``, which only logs what an async generator
    raises (the test passed), the Pipeline's in a finalizer (an unraisable exception, reported
    as "Exception ignored in: <finalize object>"). Here they are shown rather than raised, and
    every shown one that comes from tensorwire's own code is kept. ``pytest.warns`` and
    ``recwarn`` record what is warned inside them before this sees it: a test that leaks on
    purpose says so with them (or a ``filterwarnings`` mark naming ResourceWarning).

    A plain wrapper: pytest's warnings plugin wraps this one (tryfirst), so the filters this adds
    go in front of the suite's, and come off before pytest's."""
    if any("ResourceWarning" in str(arg) for mark in item.iter_markers("filterwarnings") for arg in mark.args):
        return (yield)
    leaks = item.stash[_LEAKS] = []
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def keep(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if issubclass(category, ResourceWarning) and filename.startswith(_PACKAGE):
                leaks.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = keep
        warnings.filterwarnings("always", category=ResourceWarning, module=r"tensorwire\.")
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    """Fail the test that leaked (an error at its teardown, naming what it left open), once its
    fixtures, its event loop among them, are torn down. First, while the fixtures' nodes are
    still open, collect the garbage if any peer is open: a Pipeline dropped in a reference cycle
    says so when collected, but only while its connections are open (a closed node closed them),
    so a collection after the teardown, in a later test, would find nothing to say. A collection
    costs 30-180 ms here with the suite's modules loaded (2383 tests: minutes), and few tests
    hold a peer past their body (fixtures that yield a pair), so only those pay it."""
    if _LEAKS in item.stash and _peers_open():
        gc.collect()
    leaks = [
        f"{w.category.__name__}: {w.message} ({Path(w.filename).name}:{w.lineno})" for w in item.stash.get(_LEAKS, [])
    ]
    try:
        result = yield
    except BaseException as exc:
        leaks += _child_leaks(item)
        if leaks:
            exc.add_note(_said(item, leaks))
        raise
    leaks += _child_leaks(item)
    if leaks:
        pytest.fail(_said(item, leaks), pytrace=False)
    return result


def _said(item: pytest.Item, leaks: list[str]) -> str:
    shown = "\n".join(f"  {leak}" for leak in leaks)
    return f"{item.nodeid} left tensorwire resources open:\n{shown}"


class _ChildLeaks:
    """The file that the processes the tests start write their tensorwire ResourceWarnings to
    (``tests/_child_site/sitecustomize.py``), and how far it has been read."""

    def __init__(self) -> None:
        fd, name = tempfile.mkstemp(prefix="tensorwire-child-leaks-", suffix=".log")
        os.close(fd)
        self.path = Path(name)
        self.read = 0

    def new(self) -> list[str]:
        """The lines written since the last call (a stat, when there are none: every test pays it)."""
        try:
            if self.path.stat().st_size <= self.read:
                return []
            with self.path.open("rb") as log:
                log.seek(self.read)
                data = log.read()
        except OSError:
            return []
        data = data[: data.rfind(b"\n") + 1]  # a line being written is read whole next time
        self.read += len(data)
        return data.decode("utf-8", "replace").splitlines()


def _watch_children(config: pytest.Config) -> None:
    """Make a leak in a process a test starts fail that test too: every Python process started
    from here on (``sys.executable`` scripts, the CLI, stages; not one run with -E, -I or -S)
    loads ``_child_site/sitecustomize.py``, which writes tensorwire's ResourceWarnings to a file
    that ``pytest_runtest_teardown`` reads after each test. A child that outlives its test (a
    module's fixture) is blamed on the test during which it wrote. Only this process's
    environment changes, for its children; tensorwire itself reads none of it."""
    leaks = config.stash[_CHILD_LEAKS] = _ChildLeaks()
    os.environ["TENSORWIRE_TESTS_CHILD_LEAKS"] = str(leaks.path)
    site = str(Path(__file__).resolve().parent / "_child_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)


def _child_leaks(item: pytest.Item) -> list[str]:
    """What the test's children (or a module's, see ``_watch_children``) wrote since the last
    test; nothing for a test that leaks on purpose (a ResourceWarning filter mark)."""
    watch = item.config.stash.get(_CHILD_LEAKS, None)
    said = watch.new() if watch is not None else []
    return said if _LEAKS in item.stash else []


def _peers_open() -> bool:
    """Whether any node of this process has an open peer (tensorwire's own count)."""
    if "tensorwire" not in sys.modules:  # (a test that never imported it holds no peer)
        return False
    import tensorwire.metrics

    return any(tensorwire.metrics.snapshot().peers_open.values())


def pytest_configure(config: pytest.Config) -> None:
    """Started in the background by a shell without job control (``pytest ... &`` in a script),
    this process ignores SIGINT and its children inherit that, so the tests that interrupt a
    demo or a pipeline with SIGINT would see it ignored; give SIGINT back its usual meaning."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _compile_the_checkout()
    _watch_children(config)
    _spread_by_file(config)


def _spread_by_file(config: pytest.Config) -> None:
    """Under ``-n`` (pytest-xdist; the README's test command runs ``-n 4``), hand the workers
    whole files, in the order collected, where no ``--dist`` was chosen (xdist's default,
    ``load``, is what this replaces; ``--dist worksteal`` and the others are kept). A file's
    module fixtures then start once, and test_verbs_vm.py's guests boot once: scattered over
    four workers, its six tests booted eight guests. xdist's own ordering (largest file
    first) is off: it put that file, six tests, near the end, so the guests' five minutes began
    once nearly everything else had run (see pytest_collection_modifyitems). Called before
    xdist's own pytest_configure, which reads these options."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    if config.option.dist == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In an xdist worker, the tests of modules with slow outside work (``start_in_background``)
    come first: nothing started that work early (see below), and these tests, last in the
    order, began the Soft-RoCE guests' five minutes only once every other test had run (the
    -n 4 suite took 741 s, the guests its last five minutes). First, the worker their file goes
    to (files go whole, in this order: _spread_by_file) begins them at once while the others
    run the rest. A run in one process keeps the order: there they are started at collection
    and found ready at the end. (Not xdist's ``loadgroup``: pytest-xdist 3.8 marks a group in
    the test's ``_nodeid``, which pytest 9.2 no longer reads, so every worker took some of
    these tests and each booted guests of its own.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = [item for item in items if _with_background_work(item) is not None]
    if slow:
        chosen = set(map(id, slow))
        items[:] = slow + [item for item in items if id(item) not in chosen]


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
        module = _with_background_work(item)
        if module is None or module in started or item.get_closest_marker("skip"):
            continue
        module.start_in_background()
        started.append(module)


def _with_background_work(item: pytest.Item) -> ModuleType | None:
    """The test's module where it has slow outside work to start (``start_in_background``)."""
    module = getattr(item, "module", None)
    return module if getattr(module, "start_in_background", None) is not None else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module in session.config.stash.get(_BACKGROUND, []):
        module.stop_in_background()
    watch = session.config.stash.get(_CHILD_LEAKS, None)
    if watch is not None:
        late = watch.new()  # from a child that outlived every test (none should)
        watch.path.unlink(missing_ok=True)
        if late:
            said = "\n  ".join(late)
            sys.stderr.write(f"processes the tests started left tensorwire resources open:\n  {said}\n")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
