"""Lint and type checks run with the tests, so CI enforces them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return path


def test_ruff() -> None:
    where = ["tensorwire", "scripts", "tests", "benchmarks", "examples"]
    proc = subprocess.run([_tool("ruff"), "check", *where], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format() -> None:
    """The whole tree is as ``ruff format`` leaves it (the docs' Markdown excepted: pyproject)."""
    proc = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_mypy_strict() -> None:
    proc = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "module", ["tensorwire", "tensorwire.metrics", "tensorwire.pipeline", "tensorwire.rpc", "tensorwire.tensors"]
)
def test_every_public_name_of_the_api_has_a_docstring(module: str) -> None:
    """What the package's ``__all__`` exports, and the public methods and properties its classes
    define (or inherit a docstring for), says what it is (help() showed nothing for some)."""
    import enum
    import importlib
    import inspect

    package = importlib.import_module(module)
    missing = []
    for name in package.__all__:
        obj = getattr(package, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not inspect.getdoc(obj):
            missing.append(name)
        if not inspect.isclass(obj) or issubclass(obj, (enum.Enum, BaseException)):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_") or not (isinstance(value, property) or callable(value)):
                continue
            docs = [inspect.getdoc(vars(c)[attr]) for c in obj.__mro__ if attr in vars(c)]
            if not any(docs):
                missing.append(f"{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"
