"""tests/conftest.py starts a test module's slow outside work (``start_in_background``: the
Soft-RoCE guests of test_verbs_vm.py) once collection shows the module will run, and stops it
when the session ends; run here on a module of its own in a child pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# (hypothesis's plugin took 0.5 of each child pytest's 0.75 CPU-s; nothing here uses it)
PLUGINS_OFF = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

MODULE = """
import os
from pathlib import Path

LOG = Path(os.environ["BG_LOG"])


def _say(what):
    with LOG.open("a") as f:
        f.write(what + "\\n")


def start_in_background():
    _say("start")


def stop_in_background():
    _say("stop")


def test_first():
    _say("test_first")


def test_second():
    _say("test_second")
"""


def _run(tmp_path: Path, *args: str, **env: str) -> list[str]:
    (tmp_path / "test_slow_work.py").write_text(MODULE)
    log = tmp_path / "events.log"
    log.unlink(missing_ok=True)
    child_env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    child_env.update(env, BG_LOG=str(log), PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", *PLUGINS_OFF, "-q", *args, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env,
    )
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr
    return log.read_text().split() if log.exists() else []


def test_the_work_starts_before_the_first_test_and_stops_after_the_last(tmp_path: Path) -> None:
    assert _run(tmp_path) == ["start", "test_first", "test_second", "stop"]


def test_a_deselected_module_starts_nothing(tmp_path: Path) -> None:
    assert _run(tmp_path, "-k", "no_such_test") == []


@pytest.mark.parametrize("args", [("--collect-only",), ()])
def test_no_start_when_only_collecting_or_in_an_xdist_worker(tmp_path: Path, args: tuple[str, ...]) -> None:
    env = {} if args else {"PYTEST_XDIST_WORKER": "gw0"}
    events = _run(tmp_path, *args, **env)
    assert "start" not in events and "stop" not in events, events


def test_the_checkout_is_compiled_for_the_processes_the_tests_start() -> None:
    """conftest.py writes the package's bytecode at the start of the session, whatever
    PYTHONDONTWRITEBYTECODE says, so that the processes the tests start do not each compile
    tensorwire from source; a child that cannot write bytecode then imports it from there."""
    import importlib.util

    import tensorwire.pipeline._stage as module

    source = Path(module.__file__)
    pycache = source.parent / "__pycache__"
    if not os.access(pycache if pycache.exists() else source.parent, os.W_OK):
        pytest.skip("this checkout cannot be written: conftest.py leaves it as it is")
    cached = Path(importlib.util.cache_from_source(str(source)))
    assert cached.exists(), f"no bytecode for {source}"
    assert cached.stat().st_mtime >= source.stat().st_mtime - 1, "the bytecode is older than its source"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    code = "import sys, tensorwire.pipeline._stage as m; print(m.__spec__.cached, m.__spec__.loader.path)"
    out = subprocess.run([sys.executable, "-v", "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    # python -v names the bytecode it read ("code object from '...pyc'") for every module it took from one
    assert f"code object from '{cached}'" in out.stderr, out.stderr[-2000:]
