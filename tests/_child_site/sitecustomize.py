"""Run by every Python process the tests start (``tests/conftest.py`` puts this folder on their
PYTHONPATH and names a file in TENSORWIRE_TESTS_CHILD_LEAKS): a ResourceWarning that tensorwire
gives in the child (a node, peer or Pipeline left open) is shown, and written to that file, which
conftest reads after each test and fails the test with.

Python ignores ResourceWarning by default, so a child that leaked said nothing; and making it an
error (``-W error::ResourceWarning``) changes nothing a parent can see: a node's is raised in the
loop's shutdown of async generators, which only logs it, a Pipeline's in a finalizer (unraisable),
and the child still exits 0. A child that leaks on purpose and records its warnings
(``warnings.catch_warnings(record=True)``) keeps them from this hook, as ``pytest.warns`` does in
the test process. Nothing here is part of tensorwire: a process started outside the tests never
loads it."""

import os

_FILE = os.environ.get("TENSORWIRE_TESTS_CHILD_LEAKS")

if _FILE:
    import sys
    import warnings

    _PACKAGE = os.sep + "tensorwire" + os.sep
    _shown = warnings.showwarning

    def _show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: object = None,  # (passed on as given: no typing import in every child)
        line: object = None,
    ) -> None:
        if issubclass(category, ResourceWarning) and _PACKAGE in filename:
            said = " ".join(str(message).split())
            command = " ".join(" ".join(sys.orig_argv[1:]).split())[:100]
            # one short line in one write, appended: children that leak at once do not mix lines
            with open(_FILE, "a", encoding="utf-8") as log:
                log.write(f"child {os.getpid()} ({command}): {category.__name__}: {said}\n")
        _shown(message, category, filename, lineno, file, line)  # type: ignore[arg-type]

    warnings.showwarning = _show
    warnings.filterwarnings("always", category=ResourceWarning, module=r"tensorwire\.")


def _run_the_one_this_hides() -> None:
    """A sitecustomize further along sys.path (a distribution's, a container's) would be hidden
    by this one: run it as Python would have."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # (as site.py does: a broken sitecustomize is reported, not fatal)
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}", file=sys.stderr)


_run_the_one_this_hides()
