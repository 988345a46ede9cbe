"""What every GPU test module does first: CuPy with a CUDA device, or the module skips with why;
and the lock that the tests taking most of the device's memory hold."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def cupy_with_a_device(what: str) -> Any:
    """CuPy, for a test module that needs a CUDA device (``what``: "the ... tests"); skips the
    module with the reason where CuPy is missing or finds no device."""
    with warnings.catch_warnings():  # CuPy's own import-time notices are not ours to fail on
        warnings.simplefilter("ignore")
        cp = pytest.importorskip("cupy", reason=f"CuPy is not installed: {what} need it", exc_type=ImportError)
    from tensorwire.memory._cuda import cuda_device_count

    if cuda_device_count() == 0:
        pytest.skip("CuPy is installed but finds no CUDA device", allow_module_level=True)
    return cp


def ucx_with_cuda() -> Any:
    """ucx's capabilities here, for a test module that moves CUDA memory over it; skips the
    module with the reason where ucxx is missing, ucx cannot run, or its libucx has no cuda
    transports."""
    import importlib.util

    if importlib.util.find_spec("ucxx") is None:
        why = "ucxx is not installed here (docs/gpu.md: scripts/gpu_wheels.sh carries it)"
        pytest.skip(why, allow_module_level=True)
    from tensorwire.transports.ucx import UcxTransport

    caps = UcxTransport.probe()
    if caps is None:
        pytest.skip(f"ucx cannot run here: {UcxTransport.unavailable_reason()}", allow_module_level=True)
    if "cuda" not in caps.memory_kinds:
        pytest.skip(f"this libucx has no cuda transports (lanes: {', '.join(caps.lanes)})", allow_module_level=True)
    return caps


@contextlib.contextmanager
def most_of_the_device() -> Iterator[None]:
    """Held while a test takes most of the GPU's memory (all but 2 GiB, or 40 GiB of it):
    scripts/gpu_check.sh runs the tests in several processes on one GPU, and two such tests at
    once would fail each other's allocations. A file lock, so that it holds across processes
    whatever pytest-xdist's scheduling does (its --dist loadgroup groups nothing under pytest
    9.2, whose node ids no longer take xdist's group suffix)."""
    with (Path(tempfile.gettempdir()) / "tensorwire-gpu-tests-device-memory.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
